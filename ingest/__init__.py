"""Ingesters: one source format per module, chosen by `ingest.detect`."""
