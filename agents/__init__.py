"""Retrieval, question answering with citations and hypothesis proposal (built on kb)."""
