"""The UI's Blocks: one tab per module, in the order a researcher works.

    from kb.ui.app import build, mount
    mount(fastapi_app, kb, lock)            # what `kb serve` does: the UI at /ui
"""
from __future__ import annotations

import os
import threading

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402 - after the analytics switch, which gradio reads at import

from kb.ui import chat, failures, hypotheses, jobs, runs, scaling  # noqa: E402
from kb.ui.context import UI  # noqa: E402

TABS = (chat, runs, failures, scaling, hypotheses, jobs)
PATH = "/ui"


def build(kb, lock: threading.RLock | None = None) -> gr.Blocks:
    ui = UI(kb, lock or threading.RLock())
    with gr.Blocks(title="pretrain-kb", analytics_enabled=False) as blocks:
        with gr.Tabs() as tabs:
            for module in TABS:
                with gr.Tab(module.TITLE, id=module.ID):
                    module.build(ui)
        ui.wire_links(blocks, tabs)
    return blocks


def mount(app, kb, lock: threading.RLock | None = None, path: str = PATH, tokens=None):
    """Serve the UI under `path` of a FastAPI app; returns the app. With `tokens` (the server's
    kb.server.auth.Tokens) that hold any, the UI asks for a login whose password is a write
    token: everything the UI does, the API would need that token for."""
    login = None
    if tokens is not None and tokens.writes_need_token:
        def login(username: str, password: str) -> bool:
            return tokens.can_write(password)
    return gr.mount_gradio_app(app, build(kb, lock), path=path, auth=login,
                               auth_message="Sign in with your name and a write token of this server (KB_API_TOKENS).")
