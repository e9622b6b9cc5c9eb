"""Seed noise and metric direction: what every verdict (kb.verdicts, kb.transfer, kb.patterns) and
the mixture fit (kb.mixture) share.

Runs of one project whose configs differ only in seed keys are one configuration measured several
times (kb.ablations.group_runs); their pooled standard deviation is the noise a difference has to
clear. Which way a metric is better is decided here, once (`higher_is_better`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

from sqlalchemy import select

from kb.ablations import group_runs, pooled_sd
from kb.db import chunked
from kb.errors import InsufficientData, QueryError
from kb.models import Run, RunPublic
from kb.vocab import canonical_metrics, fold, metric_name

_RUNS = Run.__table__

# words of a metric's name that say which way is better; losses are checked first
_LOWER = re.compile(r"\b(loss|nll|ppl|perplexity|error|err|bpb|bpc|wer|cer|latency|time)\b")
_HIGHER = re.compile(r"\b(acc|accuracy|f1|bleu|rouge\w*|exact match|em|pass@\d+|score|mfu|throughput"
                     r"|tokens per sec(ond)?|win rate|auc|reward)\b")


def higher_is_better(metric: str) -> bool:
    """Whether a larger `metric` is better: accuracy-like metrics yes, losses and perplexities no.
    The one place direction is decided; a metric it cannot place is an error, not a guess."""
    name = fold(metric_name(metric) or metric)
    if _LOWER.search(name):
        return False
    if _HIGHER.search(name):
        return True
    raise QueryError(f"cannot tell whether higher or lower {metric!r} is better; "
                     "pass higher=True or higher=False")


def metric_value(run, metric: str) -> float | None:
    """A run's final `metric` from its summary, under the name given or its canonical name (an
    `eval_loss` run answers to `val/loss`); None when it has no finite number for it."""
    summary = run.summary
    value = summary.get(metric)
    if value is None:
        key = canonical_metrics(summary).get(metric_name(metric) or metric)
        value = summary.get(key) if key is not None else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def read_runs(source, *, ids: Sequence[str] | None = None, project: str | None = None,
              where: str | None = None) -> list[RunPublic]:
    """Runs from a KnowledgeBase or an Engine: by id, by project, by query, in id order."""
    from kb.query import Compare, render
    from kb.query_sql import apply_query

    engine = getattr(source, "engine", source)
    if project is not None:
        scope = render(Compare(("project",), "=", project))
        where = f"({where}) and {scope}" if where else scope
    stmt = apply_query(select(*_RUNS.c), where=where) if where else select(*_RUNS.c)
    with engine.connect() as conn:
        if ids is None:
            rows = conn.execute(stmt.order_by(_RUNS.c.id)).all()
        else:
            ids = list(dict.fromkeys(ids))
            rows = [r for chunk in chunked(ids) for r in conn.execute(stmt.where(_RUNS.c.id.in_(chunk)))]
            rows.sort(key=lambda r: r.id)
    return [RunPublic.of(r) for r in rows]


class _Measured(NamedTuple):
    """A run as kb.ablations groups it: its config, and its value of one metric as `summary`."""
    id: str
    config: dict
    summary: dict


def seed_groups(runs: Iterable, project: str, metric: str) -> list:
    """kb.ablations.Config groups (runs equal but for seed keys), each run's summary reduced to
    {metric: value} so `Config.values(metric)` reads the canonical metric."""
    measured = []
    for r in runs:
        v = metric_value(r, metric)
        measured.append(_Measured(r.id, r.config, {} if v is None else {metric: v}))
    return group_runs(project, measured)


@dataclass(frozen=True)
class Noise:
    """The seed standard deviation a difference is judged against, and where it was measured."""
    sd: float
    dof: float
    source: str                              # "own seeds" | "pooled over project 'p'"
    groups: tuple[tuple[str, ...], ...]      # the seed groups (run ids) behind it

    def to_json(self) -> dict:
        return {"sd": self.sd, "dof": self.dof, "source": self.source, "groups": [list(g) for g in self.groups]}


def seed_noise(source, projects: str | Iterable[str], metric: str = "val/loss") -> Noise:
    """The pooled seed standard deviation of `metric` over every configuration of the project(s)
    run with two or more seeds (InsufficientData when none is, or their seeds agree exactly)."""
    projects = [projects] if isinstance(projects, str) else sorted(set(projects))
    groups = [g for p in projects for g in seed_groups(read_runs(source, project=p), p, metric)]
    sd, dof = pooled_sd(groups, metric)
    where = ", ".join(map(repr, projects))
    if not dof:
        raise InsufficientData(f"no seed noise for {metric} in project {where}: no configuration there "
                               "has two or more seeds with a value; repeat one config with another seed")
    if sd == 0:
        raise InsufficientData(f"every seed group of project {where} has identical {metric} values: "
                               "the seed does not reach training, so there is no noise to judge against")
    used = tuple(tuple(r.id for r in g.runs if metric in r.summary) for g in groups if len(g.values(metric)) >= 2)
    return Noise(sd, dof, f"pooled over project {where}", used)


def t_quantile(level: float, dof: float) -> float:
    """The two-sided t critical value at `level` (0.95 -> ~1.96 for many dof)."""
    from scipy.stats import t
    return float(t.ppf(0.5 + level / 2, dof))


def check_level(level: float) -> None:
    if not (isinstance(level, (int, float)) and 0 < level < 1):
        raise QueryError(f"level must be between 0 and 1 (e.g. 0.95), not {level!r}")


def judge(delta: float, low: float, high: float, higher: bool) -> str:
    """better | worse | inconclusive: an interval that excludes zero decides by the sign of delta."""
    if low <= 0 <= high:
        return "inconclusive"
    return "better" if (delta > 0) == higher else "worse"
