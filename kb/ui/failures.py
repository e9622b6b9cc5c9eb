"""The Failures tab."""
from __future__ import annotations

import gradio as gr

ID, TITLE = "failures", "Failures"


def build(ui) -> None:
    gr.Markdown("Failures")
