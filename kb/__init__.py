"""pretrain-kb: organizational memory for pretraining teams.

    from kb import KnowledgeBase
    k = KnowledgeBase.open()
    k.ingest("runs.jsonl")
    k.runs(where="config.optim.lr > 1e-3 or status = 'diverged'")
"""
__all__ = ["KnowledgeBase", "Settings"]


def __getattr__(name):     # lazy, so `kb --help` does not import the ORM
    if name == "KnowledgeBase":
        from kb.api import KnowledgeBase
        return KnowledgeBase
    if name == "Settings":
        from kb.settings import Settings
        return Settings
    raise AttributeError(name)
