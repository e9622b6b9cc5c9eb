"""The Scaling tab."""
from __future__ import annotations

import gradio as gr

ID, TITLE = "scaling", "Scaling"


def build(ui) -> None:
    gr.Markdown("Scaling")
