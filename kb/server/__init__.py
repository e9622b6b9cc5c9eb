"""The REST server behind `kb serve`: kb.server.app.create_app(kb_or_settings) builds the FastAPI app.

Routes translate HTTP to KnowledgeBase calls and back and hold no logic of their own:
runs.py (POST/GET /api/runs), agents.py (/api/ask, /api/propose), hypotheses.py, jobs.py, and
mlflow_compat.py (the part of MLflow's tracking REST API its client logs runs with).
"""
