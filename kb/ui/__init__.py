"""The Gradio UI: `build(kb, lock)` makes the Blocks, `mount(app, ...)` serves them at /ui.

A leaf: it calls the Python API (kb.api.KnowledgeBase), the same methods the REST endpoints
call, and holds no logic of its own beyond laying results out.
"""
