"""The Runs tab."""
from __future__ import annotations

import gradio as gr

ID, TITLE = "runs", "Runs"


def build(ui) -> None:
    gr.Markdown("Runs")
