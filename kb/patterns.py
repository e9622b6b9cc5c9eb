"""Patterns across ablations: the same change ablated in several projects or at several scales.

    for p in patterns(k):
        p.record        # "better in 4 of 5, effect -0.020 ± 0.010"
        p.instances     # each ablation: id, project, scale, delta, noise, outcome, run ids

An ablation (kb.ablations: a factor, its baseline, variants and the pooled seed sigma of its
runs) gives one instance per variant: the change from the baseline's level of the factor to the
variant's. Instances with the same factor name (`ablations.<name>`, a config key's last
segment), the same two levels and the same metric form a pattern, wherever they were run; one
whose roles are swapped (its baseline is the other level) counts with its delta negated. Each
instance is judged against its own seed noise as kb.verdicts judges a comparison: a t interval
on the ablation's seed sigma, or on its project's pooled seed noise when its configs have one
seed each; with no seed repeat in sight it is inconclusive. The effect is the mean delta over
the instances ± their standard deviation (how much the effect varies between projects).
"""
from __future__ import annotations

import json
import logging
import math
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass

from sqlalchemy import select

from kb.ablations import name_of
from kb.errors import InsufficientData, QueryError
from kb.models import Ablation, Run
from kb.noise import check_level, higher_is_better, judge, seed_noise, t_quantile
from kb.vocab import metric_name

log = logging.getLogger(__name__)
_ABL = Ablation.__table__
_RUNS = Run.__table__


@dataclass(frozen=True)
class Pattern:
    factor: str                 # the ablation name: a config key's last segment, or a tag's factor
    baseline_level: object      # the factor's value in the baselines
    level: object               # its value in the variants
    metric: str
    higher_is_better: bool
    better_in: int
    worse_in: int
    of: int
    effect: float               # mean delta (variant - baseline) over the instances
    spread: float | None        # their standard deviation (None with one instance)
    instances: tuple[dict, ...]

    @property
    def record(self) -> str:
        spread = f" ± {self.spread:.3f}" if self.spread is not None else ""
        return f"better in {self.better_in} of {self.of}, effect {self.effect:+.3f}{spread}"

    @property
    def evidence(self) -> list[str]:
        """The ablation ids, then every run they hold."""
        return ([i["ablation"] for i in self.instances]
                + [rid for i in self.instances for rid in i["baseline_runs"] + i["variant_runs"]])

    def to_json(self) -> dict:
        return {"factor": self.factor, "baseline_level": self.baseline_level, "level": self.level,
                "metric": self.metric, "higher_is_better": self.higher_is_better, "better_in": self.better_in,
                "worse_in": self.worse_in, "of": self.of, "effect": self.effect, "spread": self.spread,
                "record": self.record, "instances": list(self.instances), "evidence": self.evidence}


def patterns(source, *, level: float = 0.95, min_instances: int = 2) -> list[Pattern]:
    """Every change ablated `min_instances` or more times, most instances first."""
    check_level(level)
    engine = getattr(source, "engine", source)
    with engine.connect() as conn:
        rows = conn.execute(select(_ABL.c.id, _ABL.c.project, _ABL.c.factor, _ABL.c.metric, _ABL.c.baseline_run,
                                   _ABL.c.variants, _ABL.c.effect).order_by(_ABL.c.id)).all()
        params = dict(conn.execute(select(_RUNS.c.id, _RUNS.c.params)
                                   .where(_RUNS.c.id.in_(select(_ABL.c.baseline_run)))).all())
    pooled: dict[tuple[str, str], object] = {}
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for a in rows:
        for inst in _instances(source, a, level, params, pooled):
            key = (name_of(a.factor), inst["metric"], frozenset((_text(inst["from"]), _text(inst["to"]))))
            groups[key].append(inst)
    found = [_pattern(name, insts) for (name, _, _), insts in groups.items() if len(insts) >= min_instances]
    return sorted(found, key=lambda p: (-p.of, -abs(p.effect), p.factor, _text(p.level)))


def _instances(source, a, level: float, params: dict, pooled: dict) -> list[dict]:
    """One instance per variant of an ablation row that has a delta, judged against its noise."""
    if not a.metric:
        return []
    try:
        up = higher_is_better(a.metric)
    except QueryError:
        log.info("ablation %s: direction of %s unknown; left out of patterns", a.id, a.metric)
        return []
    base = next((v for v in a.variants if v["baseline"]), None)
    if base is None:
        return []
    sigma, dof, noise_from = a.effect.get("seed_sigma"), sum(max(v["seeds"] - 1, 0) for v in a.variants), "ablation"
    if not sigma:
        sigma, dof, noise_from = _project_noise(source, a.project, a.metric, pooled)
    out = []
    for v in a.variants:
        if v["baseline"] or v["delta"] is None:
            continue
        inst = {"ablation": a.id, "project": a.project, "params": params.get(a.baseline_run),
                "metric": metric_name(a.metric) or a.metric, "higher_is_better": up,
                "from": base["value"], "to": v["value"], "delta": v["delta"], "interval": None,
                "seed_sigma": sigma, "noise_from": noise_from, "outcome": "inconclusive",
                "baseline_runs": list(base["runs"]), "variant_runs": list(v["runs"])}
        if sigma:
            half = t_quantile(level, dof) * sigma * math.sqrt(1 / base["seeds"] + 1 / v["seeds"])
            inst["interval"] = [v["delta"] - half, v["delta"] + half]
            inst["outcome"] = judge(v["delta"], *inst["interval"], up)
        out.append(inst)
    return out


def _project_noise(source, project: str, metric: str, cache: dict) -> tuple[float | None, float, str | None]:
    if (project, metric) not in cache:
        try:
            cache[(project, metric)] = seed_noise(source, project, metric)
        except InsufficientData:
            cache[(project, metric)] = None
    noise = cache[(project, metric)]
    return (noise.sd, noise.dof, "project") if noise else (None, 0, None)


def _pattern(factor: str, insts: list[dict]) -> Pattern:
    """The instances put one way round (the orientation most of them were run in), then counted."""
    ways = Counter((_text(i["from"]), _text(i["to"])) for i in insts)
    way = min(ways, key=lambda w: (-ways[w], w))
    aligned = [i if (_text(i["from"]), _text(i["to"])) == way else _flipped(i) for i in insts]
    aligned.sort(key=lambda i: (i["project"], i["params"] or 0, i["ablation"]))
    deltas = [i["delta"] for i in aligned]
    first = aligned[0]
    return Pattern(factor, first["from"], first["to"], first["metric"], first["higher_is_better"],
                   sum(i["outcome"] == "better" for i in aligned), sum(i["outcome"] == "worse" for i in aligned),
                   len(aligned), statistics.fmean(deltas), statistics.stdev(deltas) if len(deltas) > 1 else None,
                   tuple(aligned))


def _flipped(i: dict) -> dict:
    """An instance seen from its variant: the levels and run roles swapped, the delta negated."""
    swap = {"better": "worse", "worse": "better", "inconclusive": "inconclusive"}
    iv = i["interval"]
    return i | {"from": i["to"], "to": i["from"], "delta": -i["delta"], "outcome": swap[i["outcome"]],
                "interval": [-iv[1], -iv[0]] if iv else None,
                "baseline_runs": i["variant_runs"], "variant_runs": i["baseline_runs"]}


def _text(value) -> str:
    return json.dumps(value, sort_keys=True, default=str)
