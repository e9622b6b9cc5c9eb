"""The Hypotheses tab."""
from __future__ import annotations

import gradio as gr

ID, TITLE = "hypotheses", "Hypotheses"


def build(ui) -> None:
    gr.Markdown("Hypotheses")
