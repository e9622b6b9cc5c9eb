"""Pick the ingester for a path or URI; a folder no ingester claims is walked for ones they do."""
from __future__ import annotations

import importlib
from pathlib import Path

from ingest.base import INGESTERS, Ingester
from kb.errors import UnknownFormat

MODULES = ("native", "mlflow", "wandb", "tensorboard", "hf_trainer", "logs", "notes")
SKIP_DIRS = {".git", "__pycache__", ".kb", ".venv", "node_modules"}


def load_ingesters() -> dict[str, Ingester]:
    for name in MODULES:
        try:
            importlib.import_module(f"ingest.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"ingest.{name}":
                raise
    return INGESTERS


def resolve(target: str, fmt: str | None = None) -> list[tuple[str, Ingester]]:
    """(target, ingester) pairs to read. `fmt` overrides detection for the target itself."""
    ingesters = load_ingesters()
    if fmt:
        if fmt not in ingesters:
            raise UnknownFormat(f"unknown format {fmt!r}; known: {sorted(ingesters)}")
        return [(target, ingesters[fmt])]
    found = _claim(target, ingesters)
    if found:
        return [found]
    path = Path(target)
    if not path.exists():
        raise UnknownFormat(f"{target}: no such file, folder or tracking URI")
    if path.is_dir():
        pairs = []
        for child in sorted(path.iterdir()):
            if child.name in SKIP_DIRS or child.name.startswith("."):
                continue
            try:
                pairs.extend(resolve(str(child)))
            except UnknownFormat:
                continue      # a stray file inside a folder of runs is not an error
        if pairs:
            return pairs
    raise UnknownFormat(f"{target}: not a format pretrain-kb reads; known formats: "
                        f"{', '.join(sorted(ingesters))} (use --format to choose one)")


def _claim(target: str, ingesters: dict[str, Ingester]) -> tuple[str, Ingester] | None:
    scores = sorted(((ing.detect(target), name) for name, ing in ingesters.items()), reverse=True)
    best, name = scores[0]
    if best <= 0:
        return None
    if len(scores) > 1 and scores[1][0] == best:
        tied = sorted(n for s, n in scores if s == best)
        raise UnknownFormat(f"{target}: ambiguous, could be {' or '.join(tied)}; use --format")
    return target, ingesters[name]
