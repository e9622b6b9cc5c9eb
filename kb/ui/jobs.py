"""The Jobs tab."""
from __future__ import annotations

import gradio as gr

ID, TITLE = "jobs", "Jobs"


def build(ui) -> None:
    gr.Markdown("Jobs")
