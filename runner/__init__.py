"""Proxy GPT trainings for approved hypotheses, their queue and execution backends."""
