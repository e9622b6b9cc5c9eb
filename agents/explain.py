"""Explanations from the records themselves: "why did run B do worse than run A" diffs the two
runs; "why did X diverge / fail" reads X's failures with their evidence lines, its anomalies, and
the ablation that shows which values of the varied factor completed. Every sentence cites the
run, failure or ablation it reads, and every number comes from those records.
"""
from __future__ import annotations

import re

from agents.evidence import Answer, Citation
from kb.fields import leaves
from kb.vocab import canonical_metrics

_WORSE = re.compile(r"\bwhy\b.*?\b(?:did|does|was|is)\b\s+(?P<b>.+?)\s+(?:do|perform|score|end|come out|turn out)?\s*"
                    r"(?:up\s+)?(?P<dir>worse|better|higher|lower)\s+than\s+(?P<a>.+?)[?.!]*$", re.I)
_FAILED = re.compile(r"\bwhy\b.*?\b(?:did|does|was|has)\b\s+(?P<x>.+?)\s+"
                     r"(?:diverge|blow up|fail|crash|die|go nan|oom|stop|hang)\w*\b", re.I)
_MAX_DIFFS = 6
_METRIC_ORDER = ("val/loss", "train/loss")


def explain(kb, question: str, retriever) -> Answer | None:
    m = _WORSE.search(question)
    if m:
        b, a = _one_run(retriever, m.group("b")), _one_run(retriever, m.group("a"))
        if a and b and a != b:
            return _compare(kb, kb.run(a), kb.run(b))
        return None
    m = _FAILED.search(question)
    if m:
        x = _one_run(retriever, m.group("x"))
        if x is None:
            hits = retriever.retrieve(question, k=5, kinds={"failure", "run"},
                                      where="status in ('diverged', 'failed', 'crashed')")
            x = next((h.chunk.run_id for h in hits if h.chunk.run_id), None)
        if x:
            return _failure(kb, kb.run(x))
    return None


def _one_run(retriever, phrase: str) -> str | None:
    linked = retriever._linked_runs(phrase)
    return linked[0] if linked else None


def _final(run) -> tuple[str, object] | None:
    metrics = canonical_metrics(run.summary)
    for name in _METRIC_ORDER:
        if name in metrics and isinstance(run.summary.get(metrics[name]), (int, float)):
            return name, run.summary[metrics[name]]
    return None


def _compare(kb, a, b) -> Answer:
    cites = [Citation("run", a.id, a.name or a.id), Citation("run", b.id, b.name or b.id)]
    out = []
    fa, fb = _final(a), _final(b)
    if fa and fb and fa[0] == fb[0]:
        out.append(f"Run {b.id} ended at {fb[0]} {fb[1]}, run {a.id} at {fa[1]} [1][2].")
    elif b.status != a.status:
        out.append(f"Run {b.id} ended with status {b.status}, run {a.id} with status {a.status} [1][2].")
    diffs = _diff(a.config, b.config) + _diff(a.scale, b.scale, "scale.")
    if diffs:
        listed = "; ".join(f"{k}: {va} in {a.id} vs {vb} in {b.id}" for k, va, vb in diffs[:_MAX_DIFFS])
        more = f" (and {len(diffs) - _MAX_DIFFS} more)" if len(diffs) > _MAX_DIFFS else ""
        out.append(f"Their configurations differ in {listed}{more} [1][2].")
    else:
        out.append(f"Their configurations are identical, so the difference is noise or data order [1][2].")
    _failure_sentences(b, cites, out)
    seen = {(x["kind"], x["key"]) for x in a.anomalies}
    for an in [x for x in b.anomalies if (x["kind"], x["key"]) not in seen][:3]:
        out.append(f"Run {b.id} had a {an['kind']} in {an['key']} at step {an['step']} that run {a.id} did not [2].")
    return Answer(" ".join(out), cites)


def _failure(kb, x) -> Answer:
    cites = [Citation("run", x.id, x.name or x.id)]
    out = [f"Run {x.id} ended with status {x.status} [1]."]
    _failure_sentences(x, cites, out)
    for an in x.anomalies[:3]:
        out.append(f"Its {an['key']} shows a {an['kind']} at step {an['step']} [1].")
    for abl in x.ablations[:2]:
        ok = [v for v in abl["variants"] if v.get("metric") is not None]
        bad = [v for v in abl["variants"] if v.get("metric") is None]
        if ok and any(x.id in (v.get("runs") or [v.get("run")]) for v in bad):
            cites.append(Citation("ablation", abl["id"], abl["factor"]))
            n = len(cites)
            values = ", ".join(str(v["value"]) for v in ok)
            out.append(f"In its ablation of {abl['factor']}, the values {values} finished while "
                       f"{', '.join(str(v['value']) for v in bad)} did not [{n}].")
    return Answer(" ".join(out), cites)


def _failure_sentences(run, cites: list[Citation], out: list[str]) -> None:
    for f in run.failures[:2]:
        if f.get("id") is None:
            continue
        cites.append(Citation("failure", str(f["id"]), (f.get("evidence") or f.get("message") or "")[:200]))
        at = f" at step {f['step']}" if f.get("step") is not None else ""
        line = (f.get("evidence") or f.get("message") or "").strip().splitlines()
        said = f": {line[0][:160]}" if line else ""
        out.append(f"Run {run.id} failed with {f['kind']}{at}{said} [{len(cites)}].")


def _diff(a: dict, b: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    la = {".".join(p): v for p, v in leaves(a) if p and not isinstance(v, (dict, list))}
    lb = {".".join(p): v for p, v in leaves(b) if p and not isinstance(v, (dict, list))}
    keys = sorted(set(la) | set(lb))
    return [(prefix + k, la.get(k, "unset"), lb.get(k, "unset")) for k in keys if la.get(k) != lb.get(k)]
