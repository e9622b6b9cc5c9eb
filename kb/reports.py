"""Experiment reports: an ablation, a hypothesis, or the runs a query selects, written up as
Markdown (and HTML) with every claim citing the runs, ablations and hypotheses it rests on.

    kb report abl-norm-1a2b3c4d5e --out reports/            # -> reports/abl-norm-1a2b3c4d5e/report.md
    kb report hyp-0123456789 --html
    kb report --where "project = 'gpt-sweep' and scale.params < 1e8"

Sections: the question; the runs (a table); their curves (a PNG beside the Markdown, an
interactive plotly chart in the HTML); the effect with its interval and the verdict
(kb.verdicts.compare: noise-aware, inconclusive unless the difference clears seed noise); scale
transfer when the same change was measured at two or more scales (kb.transfer, judged at ten
times the largest one); open risks (failures among the runs, the hypothesis's own risks).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select

from kb.ablations import name_of
from kb.errors import InsufficientData, InvalidRecord, NotFound, QueryError
from kb.models import Ablation, Failure, Hypothesis, Run
from kb.noise import metric_value, read_runs
from kb.report_render import (Block, cited_ids, curve_chart, curve_png, finite_points, html_page, markdown,
                              write_plotly_js)
from kb.vocab import canonical_metrics, metric_name

MAX_RUNS = 40           # rows in a report's table and curves on its figure
TARGET_FACTOR = 10.0    # scale transfer is judged at this multiple of the largest measured scale
DEFAULT_METRIC = "val/loss"


@dataclass
class Report:
    markdown: Path
    html: Path | None
    figures: list[Path]
    cited: list[str]
    verdicts: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"markdown": str(self.markdown), "html": str(self.html) if self.html else None,
                "figures": [str(f) for f in self.figures], "cited": self.cited, "verdicts": self.verdicts}


def write_report(k, ref: str | None = None, where: str | None = None, out: str | Path = "reports",
                 html: bool = False, metric: str | None = None) -> Report:
    """Write the report on `ref` (an ablation or hypothesis id) or on the runs `where` selects."""
    if (ref is None) == (where is None):
        raise QueryError("report on one thing: an ablation id, a hypothesis id, or --where EXPR")
    if ref is not None:
        builder = _Builder(k, _slug(ref))
        kind, row = _lookup(k.engine, ref)
        (builder.ablation if kind == "ablation" else builder.hypothesis)(row, metric)
    else:
        builder = _Builder(k, "where-" + hashlib.sha1(where.encode()).hexdigest()[:10])
        builder.selection(where, metric or DEFAULT_METRIC)
    return builder.write(Path(out), html)


def _slug(ref: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", ref).strip("-.") or "report"


def _lookup(engine, ref: str):
    with engine.connect() as conn:
        row = conn.execute(select(*Ablation.__table__.c).where(Ablation.id == ref)).first()
        if row is not None:
            return "ablation", row
        row = conn.execute(select(*Hypothesis.__table__.c).where(Hypothesis.id == ref)).first()
        if row is not None:
            return "hypothesis", row
    raise NotFound(f"no ablation or hypothesis {ref!r} (kb show RUN lists a run's ablations; kb hypotheses lists hypotheses)")


class _Builder:
    """Collects a report's blocks, its curves and its verdicts, then writes them."""

    def __init__(self, k, name: str):
        self.k, self.name = k, name
        self.blocks: list[Block] = []
        self.curves: dict[str, list] = {}
        self.metric = DEFAULT_METRIC
        self.verdicts: list[dict] = []

    def add(self, kind: str, text: str = "", items=None, header=None) -> None:
        self.blocks.append(Block(kind, text, list(items or []), list(header or [])))

    # ---- the three kinds of report -----------------------------------------------------------

    def ablation(self, a, metric: str | None) -> None:
        self.metric = metric or metric_name(a.metric) or a.metric or DEFAULT_METRIC
        base = next(v for v in a.variants if v["baseline"])
        others = [v for v in a.variants if not v["baseline"]]
        self.add("h1", f"Ablation {a.factor} in project {a.project}")
        self.add("h2", "Question")
        self.add("p", f"Does changing `{a.factor}` from {_show(base['value'])} to "
                      f"{' or '.join(_show(v['value']) for v in others)} change {self.metric} in project "
                      f"{a.project}? The ablation holds {sum(len(v['runs']) for v in a.variants)} runs "
                      f"with baseline {_cite(a.baseline_run)} [{a.id}].")
        roles = {rid: ("baseline" if v["baseline"] else "variant", v["value"]) for v in a.variants for rid in v["runs"]}
        self._runs_section(list(roles), roles)
        self.add("h2", "Effect and verdict")
        for v in others:
            self._verdict(base["runs"], v["runs"], f"{a.factor} = {_show(v['value'])} against {_show(base['value'])}")
        self._transfer(a.project, a.factor, base["value"], [v["value"] for v in others])
        self._risks(list(roles) + self._same_level(a, [v["value"] for v in others]), [])

    def hypothesis(self, h, metric: str | None) -> None:
        predicted = h.predicted or {}
        self.metric = metric or predicted.get("metric") or DEFAULT_METRIC
        with self.k.engine.connect() as conn:
            tested = sorted(conn.execute(select(Run.id).where(Run.hypothesis == h.id)).scalars())
        self.add("h1", f"Hypothesis {h.id}: {h.title}")
        self.add("h2", "Question")
        evidence = " ".join(_cite(e) for e in h.evidence)
        self.add("p", f"{h.rationale} {evidence}".strip())
        change = ", ".join(f"`{k} = {json.dumps(v)}`" for k, v in h.change.items())
        self.add("p", f"Change: {change} on baseline {_cite(h.baseline_run)} [{h.id}]. Status: {h.status}"
                      + (f", decided by {h.decided_by}" + (f" ({h.decision_reason})" if h.decision_reason else "")
                         if h.decided_by else "") + ".")
        if "delta" in predicted:
            low, high = predicted["interval"]
            self.add("p", f"Predicted: {predicted['metric']} {predicted['delta']:+.4g} (interval {low:+.4g} to "
                          f"{high:+.4g}; {predicted.get('method', '')}) [{h.id}].")
        baseline = self._seed_group(h.baseline_run)
        # run through the queue (runner.conclude): each scale's own two sides, as its result holds them
        cells = [c for c in (h.result or {}).get("scales", []) if c.get("baseline_runs") and c.get("variant_runs")]
        if cells:
            baseline = list(dict.fromkeys(r for c in cells for r in c["baseline_runs"]))
        roles = {rid: ("baseline", "") for rid in baseline} | {rid: ("hypothesis", "") for rid in tested}
        self._runs_section(list(roles), roles)
        self.add("h2", "Effect and verdict")
        if cells:
            for c in cells:
                self._verdict(c["baseline_runs"], c["variant_runs"], f"{h.id} at {_num(c.get('params'))} params")
        elif tested:
            self._verdict(baseline, tested, f"{h.id} against its baseline")
        else:
            plan = h.plan or {}
            self.add("p", f"Not tested yet: no run carries hypothesis {h.id} [{h.id}]. Its plan: "
                          f"{plan.get('seeds', '?')} seeds, {plan.get('runs', '?')} runs, {plan.get('steps', '?')} steps.")
        self._risks(list(roles), list(h.risks or []))

    def selection(self, where: str, metric: str) -> None:
        self.metric = metric
        runs = self.k.runs(where=where)
        if not runs:
            raise InsufficientData(f"no run matches {where!r}: nothing to report")
        self.add("h1", f"Runs where {where}")
        self.add("h2", "Question")
        self.add("p", f"What do the {len(runs)} runs matching `{where}` show about {metric}?")
        ids = [r.id for r in runs]
        self._runs_section(ids, {rid: ("", shown) for rid, shown in _varying(runs).items()})
        self.add("h2", "Effect and verdict")
        groups = self._ranked_configs(runs)
        if len(groups) >= 2:
            self._verdict(groups[1], groups[0], "the best configuration against the runner-up")
        else:
            self.add("p", "One configuration only (seeds aside): nothing to compare.")
        self._risks(ids, [])

    # ---- sections -----------------------------------------------------------------------------

    def _runs_section(self, ids: list[str], roles: dict) -> None:
        runs = read_runs(self.k, ids=ids)
        shown = runs[:MAX_RUNS]
        self.add("h2", "Runs")
        rows = []
        for r in shown:
            role, value = roles.get(r.id, ("", ""))
            v = metric_value(r, self.metric)
            rows.append([f"[{r.id}]", r.project, role, _show(value) if value != "" else "", _num(r.scale.get("params")),
                         r.status, "-" if v is None else f"{v:.4g}"])
        self.add("table", items=rows, header=["run", "project", "role", "value", "params", "status", self.metric])
        if len(runs) > len(shown):
            self.add("p", f"({len(runs) - len(shown)} more runs not shown.)")
        for r in shown:
            detail = self.k.run(r.id)
            key = canonical_metrics(detail.metrics).get(metric_name(self.metric) or self.metric)
            if key:
                self.curves[r.id] = finite_points(detail.metrics[key])
        if self.curves:
            self.add("figure", f"{self.metric} curves", ["curves.png"])
            self.add("p", "Curves of " + ", ".join(_cite(i) for i in self.curves) + ".")

    def _verdict(self, baseline: list[str], variant: list[str], what: str) -> None:
        from kb.verdicts import compare
        try:
            v = compare(self.k, list(baseline), list(variant), metric=self.metric)
        except (InsufficientData, QueryError) as exc:
            self.add("p", f"No verdict on {what}: {exc} " + " ".join(_cite(i) for i in list(baseline) + list(variant)))
            self.verdicts.append({"what": what, "outcome": None, "reason": str(exc)})
            return
        low, high = v.interval
        self.add("p", f"Verdict on {what}: **{v.outcome}**. {v.metric} changes by {v.delta:+.4g} "
                      f"({v.level:.0%} interval {low:+.4g} to {high:+.4g}; {v.method}, seed noise sd "
                      f"{v.noise.sd:.3g} {v.noise.source}) from {v.baseline['mean']:.4g} over {v.baseline['n']} "
                      f"runs {' '.join(_cite(i) for i in v.baseline['runs'])} to {v.variant['mean']:.4g} over "
                      f"{v.variant['n']} runs {' '.join(_cite(i) for i in v.variant['runs'])}.")
        if v.without_metric:
            self.add("p", "Left out, no final value: " + " ".join(_cite(i) for i in v.without_metric) + ".")
        self.verdicts.append({"what": what} | v.to_json())

    def _transfer(self, project: str, factor: str, base_value, variant_values: list) -> None:
        """Scale transfer, when ablations of this factor in this project span two or more scales."""
        from kb.transfer import transfer
        name = name_of(factor)
        with self.k.engine.connect() as conn:
            rows = conn.execute(select(Ablation.variants, Ablation.factor)
                                .where(Ablation.project == project)).all()
        sides = {"baseline": [], "variant": []}
        for variants, f in rows:
            if name_of(f) != name:
                continue
            for v in variants:
                if v["value"] == base_value:
                    sides["baseline"] += v["runs"]
                elif v["value"] in variant_values:
                    sides["variant"] += v["runs"]
        scales = {s for ids in sides.values() for r in read_runs(self.k, ids=ids) if (s := r.scale.get("params"))}
        if len(scales) < 2:
            return
        target = TARGET_FACTOR * max(scales)
        self.add("h2", "Scale transfer")
        try:
            t = transfer(self.k, sorted(set(sides["baseline"])), sorted(set(sides["variant"])), target=target,
                         metric=self.metric)
        except (InsufficientData, QueryError, NotFound) as exc:
            self.add("p", f"No transfer verdict: {exc}")
            return
        low, high = t.interval
        self.add("p", f"Measured at {len(scales)} scales up to {max(scales):.3g} params; at {target:.3g} params the "
                      f"effect **{t.outcome}** ({t.at_target} there): {t.delta:+.4g} ({t.level:.0%} interval "
                      f"{low:+.4g} to {high:+.4g}) against {t.proxy['delta']:+.4g} at {t.proxy['scale']:.3g}; "
                      f"{t.method} " + " ".join(_cite(i) for i in t.evidence) + ".")
        self.verdicts.append({"what": "scale transfer"} | t.to_json())

    def _risks(self, ids: list[str], stated: list[str]) -> None:
        self.add("h2", "Open risks")
        items = list(stated)
        with self.k.engine.connect() as conn:
            rows = conn.execute(select(Failure.run_id, Failure.kind, Failure.step, Failure.message)
                                .where(Failure.run_id.in_(ids)).order_by(Failure.run_id, Failure.id)).all() if ids else []
        for run_id, kind, step, message in rows:
            at = f" at step {step}" if step is not None else ""
            items.append(f"{kind}{at}: {message or 'no message'} [{run_id}]")
        self.add("list", items=items) if items else self.add("p", "None on record among these runs.")

    # ---- helpers ------------------------------------------------------------------------------

    def _same_level(self, a, values: list) -> list[str]:
        """Runs of the project outside the ablation that set the factor to a variant's level: their
        failures are risks of the change too (rmsnorm diverging at a larger scale)."""
        if not a.factor.startswith("config."):
            return []
        from kb.fields import lookup
        from kb.hypotheses import split_key
        try:
            path = split_key(a.factor[len("config."):])
        except InvalidRecord:
            return []
        members = {rid for v in a.variants for rid in v["runs"]}
        return [r.id for r in read_runs(self.k, project=a.project)
                if r.id not in members and r.status != "completed" and (found := lookup(r.config, path))[0]
                and found[1] in values]

    def _seed_group(self, run_id: str) -> list[str]:
        """The run and its seed repeats (kb.noise.seed_groups: configs equal but for seed keys)."""
        from kb.noise import seed_groups
        found = read_runs(self.k, ids=[run_id])
        if not found:
            return [run_id]
        project = found[0].project
        for g in seed_groups(read_runs(self.k, project=project), project, self.metric):
            if any(r.id == run_id for r in g.runs):
                return [r.id for r in g.runs]
        return [run_id]

    def _ranked_configs(self, runs) -> list[list[str]]:
        """The selection's configurations (seeds aside) with a value, best mean first."""
        from kb.noise import higher_is_better, seed_groups
        up = higher_is_better(self.metric)
        groups = []
        for project in sorted({r.project for r in runs}):
            for g in seed_groups([r for r in runs if r.project == project], project, self.metric):
                values = g.values(self.metric)
                if values:
                    groups.append((sum(values) / len(values), [r.id for r in g.runs]))
        groups.sort(key=lambda g: -g[0] if up else g[0])
        return [ids for _, ids in groups]

    def write(self, out: Path, html: bool) -> Report:
        folder = out / self.name
        folder.mkdir(parents=True, exist_ok=True)
        figures = []
        if self.curves:
            figures.append(curve_png(self.curves, self.metric, folder / "curves.png"))
        md = folder / "report.md"
        md.write_text(markdown(self.blocks), encoding="utf-8")
        page = None
        if html:
            charts = {"curves.png": curve_chart(self.curves, self.metric)} if self.curves else {}
            write_plotly_js(folder)
            page = folder / "report.html"
            page.write_text(html_page(self.blocks, self.blocks[0].text, charts), encoding="utf-8")
        return Report(md, page, figures, cited_ids(self.blocks), self.verdicts)


def _varying(runs) -> dict[str, str]:
    """Each run's values of the config keys (seeds aside) that differ across the selection."""
    from kb.ablations import parts_of
    sigs = {r.id: parts_of(r.project, r.config)[0] for r in runs}
    seen: dict[str, set] = {}
    for sig in sigs.values():
        for k, v in sig.items():
            seen.setdefault(k, set()).add(v)
    # a key varies when it takes two values, or some run lacks it
    keys = sorted(k for k, vs in seen.items() if len(vs) > 1 or any(k not in sig for sig in sigs.values()))
    more = " ..." if len(keys) > 3 else ""
    shown = lambda s, k: _show(json.loads(s[k])) if k in s else "-"      # noqa: E731  (values are JSON text)
    return {rid: ", ".join(f"{k}={shown(s, k)}" for k in keys[:3]) + more for rid, s in sigs.items()}


def _cite(ref: str) -> str:
    return f"[{ref}]"


def _show(v) -> str:
    return json.dumps(v, sort_keys=True) if not isinstance(v, str) else v


def _num(v) -> str:
    return f"{v:.3g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"
