"""What the proposer works from and what its sources hand it: the History of runs in scope (each
run's final metric and failures) and Candidate hypotheses, before they are checked and stored.

Every source (agents/surrogate.py, agents/proposal_sources.py) turns History into Candidates;
agents/propose.py checks them (agents/proposal_checks.py), drops what the store already holds,
adds risks and a validation plan, and stores the rest.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from sqlalchemy import select

from kb.models import Failure, RunPublic
from kb.noise import higher_is_better, metric_value
from kb.vocab import metric_name

DEFAULT_METRIC = "val/loss"
FALLBACK_METRIC = "train/loss"      # a project that logs no validation loss is judged on training loss
BLOCKING = ("diverged", "oom")      # failures that say the config itself cannot train


@dataclass
class Candidate:
    source: str                     # surrogate | ablation | pattern | mixture | llm
    project: str
    baseline: str                   # run id
    change: dict                    # dotted config key -> new value
    title: str
    rationale: str
    evidence: list[str]
    predicted: dict                 # {"metric", "delta", "interval", "level", "method"}
    noise_sd: float | None = None   # seed noise at the baseline, for sizing the plan
    scales: list[float] = field(default_factory=list)   # extra (larger) scales to validate at

    @property
    def gain(self) -> float:
        """How much better the prediction is (positive: better), for ranking candidates."""
        d = self.predicted["delta"]
        return d if self.predicted.get("higher_is_better") else -d


class History:
    """The runs a proposal may draw on, with their final metric and failures, read once."""

    def __init__(self, runs: list[RunPublic], failures: dict[str, list[dict]], metric: str):
        self.runs = runs
        self.by_id = {r.id: r for r in runs}
        self.failures = failures
        self.metric = metric
        self.higher = higher_is_better(metric)
        self._values = {r.id: metric_value(r, metric) for r in runs}

    @classmethod
    def load(cls, kb, goal: str = "", metric: str | None = None) -> "History":
        runs = kb.runs()
        with kb.engine.connect() as conn:
            rows = conn.execute(select(Failure.run_id, Failure.id, Failure.kind, Failure.step, Failure.message)
                                .order_by(Failure.id)).all()
        failures: dict[str, list[dict]] = defaultdict(list)
        for run_id, fid, kind, step, message in rows:
            failures[run_id].append({"id": fid, "kind": kind, "step": step, "message": message})
        metric = metric or goal_metric(goal)
        if metric == DEFAULT_METRIC and not any(metric_value(r, metric) is not None for r in runs):
            metric = FALLBACK_METRIC
        return cls(runs, dict(failures), metric)

    def value(self, run_id: str) -> float | None:
        return self._values.get(run_id)

    def failed(self, run_id: str) -> str | None:
        """The failure that says this run's config could not train (diverged, oom), if any."""
        run = self.by_id.get(run_id)
        if run is not None and run.status == "diverged":
            return "diverged"
        return next((f["kind"] for f in self.failures.get(run_id, ()) if f["kind"] in BLOCKING), None)

    def better(self, a: float, b: float) -> bool:
        return a > b if self.higher else a < b

    def best(self, run_ids) -> str | None:
        """The run with the best final metric among these (ties: the smaller id)."""
        scored = [(self.value(i), i) for i in run_ids if self.value(i) is not None]
        if not scored:
            return None
        return min(scored, key=lambda p: (-p[0] if self.higher else p[0], p[1]))[1]

    def scale_of(self, run_id: str) -> float | None:
        run = self.by_id.get(run_id)
        p = run.scale.get("params") if run else None
        return float(p) if isinstance(p, (int, float)) and math.isfinite(p) else None


def goal_metric(goal: str) -> str:
    """The metric a goal names (`lower val/loss at fixed compute`, `raise eval accuracy`); val/loss
    when it names none, or names a bare "loss" (people mean the held-out one)."""
    words = [w.strip(".,;:()") for w in goal.replace("-", " ").split()]
    for size in (3, 2, 1):           # the longest phrase first: "validation loss" over "loss"
        for i in range(len(words) - size + 1):
            name = metric_name(" ".join(words[i:i + size]))
            if name == "train/loss" and "train" not in goal.lower():
                return DEFAULT_METRIC
            if name is not None and name != "lr":
                return name
    return DEFAULT_METRIC
