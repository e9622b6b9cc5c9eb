"""The Chat tab."""
from __future__ import annotations

import gradio as gr

ID, TITLE = "chat", "Chat"


def build(ui) -> None:
    gr.Markdown("Chat")
