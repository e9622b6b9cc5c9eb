"""A hypothesis concluded from its jobs' runs: the effect with its interval at each scale, the
noise-aware verdict (kb.verdicts.compare), scale transfer (kb.transfer) when it ran at two or more
scales, and whether the gain is verified: better than seed noise at its first scale and again at
a second one. Stored as the hypothesis's `result`, with status `done`.

    result = conclude_if_done(k, "hyp-1a2b3c4d5e")     # None while any of its jobs is unfinished

`result`:
    {"metric", "outcome": better | worse | inconclusive | no verdict, "verified": bool,
     "effect": {"delta", "interval", "level", "method"},        # at the first scale
     "scales": [{"params", "outcome", "delta", "interval", "method", "baseline_runs", "variant_runs"}],
     "transfer": kb.transfer's JSON, judged at 10x the largest scale, or null,
     "runs": {"baseline": [...], "variant": [...]}, "jobs": {"succeeded", "failed", "cancelled"},
     "errors": [why a verdict could not be given], "concluded_at"}
"""
from __future__ import annotations

import logging

from sqlalchemy import select, update

from kb.errors import KBError
from kb.models import Hypothesis, Job, utcnow
from kb.noise import read_runs
from runner.queue import FINISHED, listed

log = logging.getLogger(__name__)
TARGET_FACTOR = 10.0        # transfer is judged at this multiple of the largest scale run (as kb.reports)
DEFAULT_METRIC = "val/loss"


def conclude_if_done(kb, hypothesis: str | None) -> dict | None:
    """When every job of the hypothesis has finished, compute and store its result."""
    if not hypothesis:
        return None
    jobs = listed(kb.engine, hypothesis=hypothesis)
    if not jobs or any(j["status"] not in FINISHED for j in jobs):
        return None
    result = judge(kb, hypothesis, jobs)
    with kb.engine.begin() as conn:
        conn.execute(update(Hypothesis.__table__).where(Hypothesis.id == hypothesis)
                     .values(result=result, status="done"))
    log.info("hypothesis %s: %s%s", hypothesis, result["outcome"], " (verified)" if result["verified"] else "")
    return result


def judge(kb, hypothesis: str, jobs: list[dict]) -> dict:
    from kb.hypotheses import get
    from kb.verdicts import compare, transfer

    h = get(kb.engine, hypothesis)
    metric = (h.get("predicted") or {}).get("metric") or DEFAULT_METRIC
    cells = _cells(kb, jobs)
    errors, scales = [], []
    for depth in sorted(cells):
        sides = cells[depth]
        base, var = sides.get("baseline", []), sides.get("variant", [])
        entry = {"params": _params(kb, base + var), "n_layer": depth, "baseline_runs": base, "variant_runs": var}
        if not base or not var:
            errors.append(f"n_layer {depth}: no finished run on the {'baseline' if not base else 'variant'} side")
            scales.append(entry | {"outcome": "no verdict"})
            continue
        try:
            v = compare(kb, base, var, metric=metric)
        except KBError as exc:
            errors.append(f"n_layer {depth}: {exc}")
            scales.append(entry | {"outcome": "no verdict"})
            continue
        scales.append(entry | {"outcome": v.outcome, "delta": v.delta, "interval": list(v.interval),
                               "level": v.level, "method": v.method, "noise_sd": v.noise.sd,
                               "without_metric": list(v.without_metric)})
    judged = [s for s in scales if "delta" in s]
    first = judged[0] if judged else None
    found = None
    measured = [s for s in scales if s["baseline_runs"] and s["variant_runs"]]
    if len(measured) >= 2 and all(s["params"] for s in measured):
        try:
            found = transfer(kb, [r for s in measured for r in s["baseline_runs"]],
                             [r for s in measured for r in s["variant_runs"]],
                             target=TARGET_FACTOR * max(s["params"] for s in measured), metric=metric).to_json()
        except KBError as exc:
            errors.append(f"scale transfer: {exc}")
    by_status = {s: [j["id"] for j in jobs if j["status"] == s] for s in FINISHED}
    return {
        "metric": metric,
        "outcome": first["outcome"] if first else "no verdict",
        "verified": bool(first and first["outcome"] == "better" and len(judged) >= 2
                         and all(s["outcome"] == "better" for s in judged[1:])),
        "effect": ({"delta": first["delta"], "interval": first["interval"], "level": first["level"],
                    "method": first["method"], "params": first["params"]} if first else None),
        "scales": scales,
        "transfer": found,
        "runs": {side: [r for s in scales for r in s[f"{side}_runs"]] for side in ("baseline", "variant")},
        "jobs": by_status | {"errors": {j["id"]: j["error"] for j in jobs if j["status"] == "failed"}},
        "errors": errors,
        "concluded_at": utcnow().isoformat(),
    }


def _cells(kb, jobs: list[dict]) -> dict[int, dict[str, list[str]]]:
    """{n_layer: {side: [run ids]}} of the jobs that left a run."""
    out: dict[int, dict[str, list[str]]] = {}
    specs = _specs(kb, [j["id"] for j in jobs])
    for j in jobs:
        spec = specs[j["id"]]
        if j["run"] and spec.get("side") in ("baseline", "variant"):
            out.setdefault(int(spec["n_layer"]), {}).setdefault(spec["side"], []).append(j["run"])
    return out


def _specs(kb, ids: list[str]) -> dict[str, dict]:
    with kb.engine.connect() as conn:
        return dict(conn.execute(select(Job.id, Job.spec).where(Job.id.in_(ids))).all()) if ids else {}


def _params(kb, run_ids: list[str]) -> float | None:
    values = [r.scale.get("params") for r in read_runs(kb, ids=run_ids)] if run_ids else []
    values = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return sum(values) / len(values) if values else None
