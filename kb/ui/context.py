"""What every tab gets: the open KnowledgeBase, the server's lock, and deep links between tabs.

A citation is a link (`?run=ID`, `?note=ID`, `?ablation=ID`, `?hypothesis=ID`, `?job=ID`); the
page that opens reads its query and shows the record in the tab that owns that kind. A tab
registers what it shows with `ui.link(kind, tab_id, show, outputs)`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import quote

import gradio as gr

LINK_KINDS = ("run", "note", "ablation", "failure", "hypothesis", "job")


def href(kind: str, ref: str) -> str:
    """A link to a record, relative to the UI's own page, so it works behind any mount path."""
    if kind not in LINK_KINDS:
        raise ValueError(f"no page shows a {kind!r}")
    return f"?{kind}={quote(str(ref), safe='')}"


def in_arrival_order(group: str) -> dict:
    """Options for the listeners that write the same component, so they run one at a time in the
    order they were asked: Gradio runs different listeners side by side, and of two writing one
    table the last to finish wins (a page-load listing over a filter applied meanwhile). One
    concurrency group of one is served first in, first out. Groups are server-wide: keep slow
    listeners out of them."""
    return {"concurrency_id": group, "concurrency_limit": 1}


@dataclass
class Link:
    tab: str
    show: Callable[[str], dict]         # ref -> {component: value or update}
    outputs: list


@dataclass
class UI:
    kb: object                          # kb.api.KnowledgeBase
    lock: threading.RLock               # held around whatever touches the vector index or the LLM
    links: dict[str, Link] = field(default_factory=dict)

    def link(self, kind: str, tab: str, show: Callable[[str], dict], outputs: list) -> None:
        if kind not in LINK_KINDS:
            raise ValueError(f"unknown link kind {kind!r}")
        self.links[kind] = Link(tab, show, outputs)

    def locked(self, fn, *args, **kwargs):
        with self.lock:
            return fn(*args, **kwargs)

    def wire_links(self, blocks: gr.Blocks, tabs: gr.Tabs) -> None:
        """On page load, open the record the URL names (if any) in its tab."""
        outputs = [tabs] + [c for link in self.links.values() for c in link.outputs]

        def opened(request: gr.Request):
            params = dict(request.query_params) if request is not None else {}
            for kind, link in self.links.items():
                ref = params.get(kind)
                if ref:
                    return {tabs: gr.Tabs(selected=link.tab), **link.show(ref)}
            # an empty dict is one value to Gradio, not "no updates": with several outputs
            # registered it fails ("didn't return enough output values") on every plain page load
            return {tabs: gr.skip()}

        blocks.load(opened, inputs=None, outputs=outputs, show_progress="hidden")
