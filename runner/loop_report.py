"""The experiment loop's report: what was tried, what was kept and why, what failed, and the best
verified improvement over the starting baseline, every claim citing the runs and hypotheses it
rests on.

    report = write_loop_report(k, "tiny", rounds=[...], stopped="3 round(s) done", approve="auto")
    report.markdown          # <out>/loop-<project>/report.md
    report.kept              # the hypotheses whose gain beat seed noise at two scales

It covers every concluded hypothesis of the project (so a rerun's report includes what earlier runs
of the loop tried). Kept means verified (runner.conclude): better than seed noise at its first
scale and again at a second one; a gain at one scale only, an inconclusive or worse result, or a
plan that failed is listed under "Not kept" with the reason. The best verified improvement is the
kept variant with the lowest mean at the starting baseline's scale, compared with the starting
baseline's own seeds (kb.verdicts.compare) and named only when that comparison also says better.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from kb.errors import KBError
from kb.noise import higher_is_better, metric_value, read_runs
DEFAULT_OUT = "reports"
START_TAG, BASELINE_TAG = "loop:start", "loop:baseline"     # the runs a loop started a project with


@dataclass
class LoopReport:
    project: str
    markdown: Path
    rounds: list[dict]
    kept: list[str]
    not_kept: list[str]
    failed_runs: list[str]
    best: dict | None
    stopped: str
    starting_baseline: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"project": self.project, "markdown": str(self.markdown), "stopped": self.stopped,
                "rounds": self.rounds, "kept": self.kept, "not_kept": self.not_kept,
                "failed_runs": self.failed_runs, "best": self.best, "starting_baseline": self.starting_baseline}


def write_loop_report(kb, project: str, *, goal: str, rounds: list[dict], stopped: str, approve: str,
                      started_baseline: bool = False, out: str | None = None) -> LoopReport:
    hyps = [h for h in kb.hypotheses(project=project) if h["status"] == "done" and h["result"]]
    hyps.sort(key=lambda h: h["created_at"] or "")
    start = _starting_baseline(kb, project, hyps)
    metric = next((h["result"]["metric"] for h in hyps), "val/loss")
    kept = [h for h in hyps if h["result"]["verified"]]
    rest = [h for h in hyps if not h["result"]["verified"]]
    failed = [r for r in read_runs(kb, project=project) if r.status in ("diverged", "failed")]
    best = _best(kb, start, kept, metric)
    lines = [f"# Experiment loop: project {project}", ""]
    lines += [f"Goal: {goal or 'lower ' + metric}. Metric: {metric} ({_direction(metric)} is better). "
              f"Approval: {approve}"
              + (" (the proposer's top-ranked proposal whose plan fits the run budget)" if approve == "auto" else "")
              + f". This run: {len(rounds)} round(s); stopped because {stopped}.", ""]
    lines += ["## Starting baseline", ""]
    if start:
        mean = _mean(kb, start, metric)
        lines.append(f"{'Started by this run: ' if started_baseline else ''}{len(start)} seed(s), mean {metric} "
                     f"{_num(mean)} {_cite(start)}.")
    else:
        lines.append("None found: no run carries the tag `loop:baseline` and no hypothesis has concluded.")
    lines += ["", "## What was tried", ""]
    if hyps:
        lines += ["| hypothesis | change | first scale | second scale | verified |", "|---|---|---|---|---|"]
        lines += [_row(h) for h in hyps]
    else:
        lines.append("Nothing has concluded yet.")
    lines += ["", "## Kept (verified improvements)", ""]
    lines += [_kept_line(h) for h in kept] or ["None: no change beat seed noise at two scales."]
    lines += ["", "## Not kept", ""]
    lines += [_not_kept_line(h) for h in rest] or ["Nothing."]
    lines += ["", "## What failed", ""]
    lines += [_failed_line(kb, r) for r in failed] or ["No run diverged or failed."]
    lines += _failed_jobs(hyps)
    lines += ["", "## Best verified improvement over the starting baseline", ""]
    lines.append(_best_line(best, metric))
    folder = Path(out or DEFAULT_OUT) / ("loop-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", project))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    (folder / "report.json").write_text(json.dumps({"rounds": rounds, "stopped": stopped}, default=str, indent=1))
    return LoopReport(project, path, rounds, [h["id"] for h in kept], [h["id"] for h in rest],
                      [r.id for r in failed], best, stopped, start)


def _starting_baseline(kb, project: str, hyps: list[dict]) -> list[str]:
    runs = [r for r in read_runs(kb, project=project) if BASELINE_TAG in r.tags]
    if runs:
        return [r.id for r in runs]
    return hyps[0]["result"]["scales"][0]["baseline_runs"] if hyps and hyps[0]["result"]["scales"] else []


def _best(kb, start: list[str], kept: list[dict], metric: str) -> dict | None:
    """The kept variant best at the starting baseline's scale, compared with the starting baseline."""
    from kb.verdicts import compare
    if not start or not kept:
        return None
    depth = _depth(kb, start)
    candidates = []
    for h in kept:
        cell = next((s for s in h["result"]["scales"] if s.get("n_layer") == depth and s["variant_runs"]), None)
        if cell:
            candidates.append((_mean(kb, cell["variant_runs"], metric), h, cell["variant_runs"]))
    if not candidates:
        return None
    up = higher_is_better(metric)
    mean, h, runs = sorted(candidates, key=lambda c: -c[0] if up else c[0])[0]
    try:
        v = compare(kb, start, runs, metric=metric)
    except KBError as exc:
        return {"hypothesis": h["id"], "outcome": "no verdict", "error": str(exc), "variant_runs": runs,
                "baseline_runs": start}
    return {"hypothesis": h["id"], "change": h["change"], "outcome": v.outcome, "delta": v.delta,
            "interval": list(v.interval), "method": v.method, "baseline_runs": v.baseline["runs"],
            "variant_runs": v.variant["runs"]}


def _depth(kb, run_ids: list[str]) -> int | None:
    runs = read_runs(kb, ids=run_ids)
    return runs[0].config.get("n_layer") if runs else None


def _mean(kb, run_ids: list[str], metric: str) -> float | None:
    values = [v for r in read_runs(kb, ids=run_ids) if (v := metric_value(r, metric)) is not None]
    return sum(values) / len(values) if values else None


def _direction(metric: str) -> str:
    try:
        return "higher" if higher_is_better(metric) else "lower"
    except KBError:
        return "lower"


def _scale_words(s: dict) -> str:
    if "delta" not in s:
        return f"{_num(s.get('params'))} params: no verdict"
    low, high = s["interval"]
    return (f"{_num(s['params'])} params: {s['outcome']}, {s['delta']:+.4f} [{low:+.4f}, {high:+.4f}] "
            f"({s['method']}) {_cite(s['baseline_runs'] + s['variant_runs'])}")


def _row(h: dict) -> str:
    scales = h["result"]["scales"]
    first = _scale_words(scales[0]) if scales else "-"
    second = _scale_words(scales[1]) if len(scales) > 1 else "not run"
    return (f"| {h['id']} ({h['title']}) | `{json.dumps(h['change'])}` | {first} | {second} | "
            f"{'yes' if h['result']['verified'] else 'no'} |")


def _kept_line(h: dict) -> str:
    r = h["result"]
    scales = "; ".join(_scale_words(s) for s in r["scales"] if "delta" in s)
    t = r.get("transfer")
    transfer = (f" Scale transfer to {_num(t['target'])} params: {t['outcome']} "
                f"({t['delta']:+.4f} [{t['interval'][0]:+.4f}, {t['interval'][1]:+.4f}]).") if t else ""
    return f"- {h['id']}: `{json.dumps(h['change'])}` is better than seed noise at every scale run: {scales}.{transfer} [{h['id']}]"


def _not_kept_line(h: dict) -> str:
    r = h["result"]
    judged = [s for s in r["scales"] if "delta" in s]
    if not judged:
        why = "no verdict: " + ("; ".join(r.get("errors") or []) or "no runs finished")
    elif r["outcome"] != "better":
        why = f"{r['outcome']} at its first scale ({_scale_words(judged[0])})"
    elif len(judged) < 2:
        why = f"better at one scale only ({_scale_words(judged[0])}); not checked at a second"
    else:
        bad = next(s for s in judged[1:] if s["outcome"] != "better")
        why = f"better at its first scale but {bad['outcome']} at the second ({_scale_words(bad)})"
    return f"- {h['id']} `{json.dumps(h['change'])}`: {why} [{h['id']}]"


def _failed_line(kb, r) -> str:
    failures = kb.run(r.id).failures
    f = failures[0] if failures else {}
    what = f"{f.get('kind', r.status)}" + (f" at step {f['step']}" if f.get("step") is not None else "")
    message = f": {f['message']}" if f.get("message") else ""
    return (f"- {r.id} {r.status} ({what}{message}); lr {_num(r.config.get('lr'))}, "
            f"n_layer {r.config.get('n_layer')} [{r.id}]")


def _failed_jobs(hyps: list[dict]) -> list[str]:
    out = []
    for h in hyps:
        for job_id, error in (h["result"].get("jobs") or {}).get("errors", {}).items():
            out.append(f"- job {job_id} of {h['id']} failed: {error}")
    return out


def _best_line(best: dict | None, metric: str) -> str:
    if not best:
        return "None: no change was verified at two scales."
    if best["outcome"] != "better":
        detail = best.get("error") or (f"{best['delta']:+.4f} [{best['interval'][0]:+.4f}, {best['interval'][1]:+.4f}]"
                                       if "delta" in best else "")
        return (f"None over the starting baseline: the best kept change, {best['hypothesis']}, is "
                f"{best['outcome']} against it ({detail}) {_cite(best['baseline_runs'] + best['variant_runs'])}.")
    low, high = best["interval"]
    return (f"{best['hypothesis']}: `{json.dumps(best['change'])}` changes {metric} by {best['delta']:+.4f} "
            f"[{low:+.4f}, {high:+.4f}] against the starting baseline ({best['method']}); evidence: "
            f"baseline {_cite(best['baseline_runs'])}, variant {_cite(best['variant_runs'])} [{best['hypothesis']}].")


def _cite(ids: list[str]) -> str:
    return " ".join(f"[{i}]" for i in ids)


def _num(v) -> str:
    return "-" if v is None else f"{v:.4g}"
