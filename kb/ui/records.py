"""Records laid out for reading: the runs table, a run's detail page, a note, an ablation, a
failure, and the config diff of runs side by side. Markdown and table dicts, no Gradio here.

    table = runs_table(kb.runs(where="status = 'diverged'"))       # gr.Dataframe's value
    md = run_markdown(kb.run("lr3e-4-s0").as_dict())                # gr.Markdown's value
    diff = config_diff({"a": {"optim": {"lr": 1e-3}}, "b": {"optim": {"lr": 3e-3}}})

Every value a person reads passes through `fmt` (numbers to 4 significant digits, sizes as
10M/1.2B, NaN as NaN, nothing as an em dash), and every piece of record text through `esc`,
so a run named `a|b*` or a note holding HTML is shown as written, not as markup.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Iterable, Mapping

from kb.fields import canonical, leaves
from kb.ui.context import href

NONE = "—"
SCALE_KEYS = ("params", "tokens", "flops")
PREFERRED_METRICS = ("val/loss", "train/loss", "val/ppl", "val/accuracy")
TABLE_METRICS = 3          # metrics shown as columns, final and best each
STATUS_STYLE = {"diverged": "color: #b91c1c; font-weight: 600", "failed": "color: #b91c1c; font-weight: 600",
                "crashed": "color: #b91c1c; font-weight: 600", "killed": "color: #b45309",
                "running": "color: #1d4ed8", "completed": "color: #15803d"}
FAILED_STATUSES = {"diverged", "failed", "crashed", "killed"}


# ---- values ------------------------------------------------------------------------------

def human(n: float | int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}" if isinstance(n, float) else str(n)


def fmt(v: Any, size: bool = False) -> str:
    """A value as a person reads it; `size` shows counts as 10M, 1.2B."""
    if v is None:
        return NONE
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        if isinstance(v, float) and not math.isfinite(v):
            return "NaN" if math.isnan(v) else ("inf" if v > 0 else "-inf")
        if size:
            return human(v)
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    if isinstance(v, (dict, list)):
        return json.dumps(v, separators=(", ", ": "), default=str)
    return str(v)


_MARKUP = re.compile(r"([\\`*_{}\[\]<>|#])")


def esc(text: Any) -> str:
    """Record text safe inside Markdown (tables included): markup characters escaped, one line."""
    return _MARKUP.sub(r"\\\1", " ".join(str(text).split()))


def code_block(text: str, lang: str = "") -> str:
    """`text` verbatim in a fenced block whose fence no run of backticks inside can close."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}"


def problem_markdown(label: str, message: str) -> str:
    """An error as a tab shows it: its first line as text, its later lines (a query and the caret
    under its column) in a monospace block, so the caret stays under the character it points at."""
    first, _, rest = str(message).partition("\n")
    out = f"**{label}:** {esc(first)}"
    return out + ("\n\n" + code_block(rest.rstrip("\n"), "text") if rest.strip() else "")


def problem(exc: Exception) -> str:
    return problem_markdown(type(exc).__name__, str(exc))


def link(kind: str, ref: str, label: str | None = None) -> str:
    return f"[{esc(label or ref)}]({href(kind, ref)})"


def md_table(headers: list[str], rows: Iterable[list[str]]) -> str:
    rows = list(rows)
    if not rows:
        return ""
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def flatten(config: Mapping) -> dict[str, Any]:
    """{dotted key: leaf}, keys spelled as the query language takes them (`optim.lr`, `"a b".c`)."""
    return {canonical(path): value for path, value in leaves(config) if path}


# ---- the runs table ----------------------------------------------------------------------

def table_metrics(runs: list[Mapping]) -> list[str]:
    """The canonical metrics to show as columns: the usual ones first, then the most common."""
    counts: dict[str, int] = {}
    for r in runs:
        for name, view in (r.get("canonical") or {}).items():
            if str(view.get("key", "")).startswith("summary."):
                counts[name] = counts.get(name, 0) + 1
    ranked = sorted(counts, key=lambda n: (n not in PREFERRED_METRICS,
                                           PREFERRED_METRICS.index(n) if n in PREFERRED_METRICS else 0,
                                           -counts[n], n))
    return ranked[:TABLE_METRICS]


def metric_key(run: Mapping, metric: str) -> str | None:
    """The key a run logged a canonical metric under (`eval_loss` for val/loss), or None."""
    view = (run.get("canonical") or {}).get(metric)
    if view and str(view.get("key", "")).startswith("summary."):
        return view["key"][len("summary."):]
    return metric if metric in (run.get("summary") or {}) else None


def runs_table(runs: Iterable) -> dict:
    """gr.Dataframe's value: raw numbers to sort by, `display_value` to read, status coloured.
    Columns: id, project, name, status, lr, batch size, params, tokens, and final and best of the
    main metrics."""
    runs = [r if isinstance(r, Mapping) else r.model_dump() for r in runs]
    metrics = table_metrics(runs)
    headers = ["id", "project", "name", "status", "lr", "batch_size", "params", "tokens"]
    for m in metrics:
        headers += [m, f"{m} best"]
    data, shown, styles = [], [], []
    for r in runs:
        scale = r.get("scale") or {}
        raw = [r["id"], r.get("project"), r.get("name"), r.get("status"), r.get("lr"), r.get("batch_size"),
               r.get("params") or scale.get("params"), r.get("tokens") or scale.get("tokens")]
        text = raw[:4] + [fmt(raw[4]), fmt(raw[5]), fmt(raw[6], size=True), fmt(raw[7], size=True)]
        for m in metrics:
            key = metric_key(r, m)
            final = (r.get("summary") or {}).get(key) if key else None
            best = ((r.get("stats") or {}).get(key) or {}).get("best") if key else None
            raw += [_sortable(final), _sortable(best)]
            text += [fmt(final), fmt(best)]
        data.append(raw)
        shown.append([NONE if t is None else str(t) for t in text])
        styles.append(["", "", "", STATUS_STYLE.get(r.get("status"), "")] + [""] * (len(raw) - 4))
    return {"headers": headers, "data": data, "metadata": {"display_value": shown, "styling": styles}}


def _sortable(v: Any) -> float | None:
    """A number a table can sort (None for a missing or non-numeric value, NaN included)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


# ---- comparing configs -------------------------------------------------------------------

def config_diff(configs: Mapping[str, Mapping]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows): only the dotted config keys whose values differ between the runs (a key
    one run lacks differs), one column per run, keys in the first run's order."""
    flat = {label: flatten(cfg or {}) for label, cfg in configs.items()}
    keys: dict[str, None] = {}
    for f in flat.values():
        keys.update(dict.fromkeys(f))
    missing = object()
    rows = []
    for key in keys:
        values = [f.get(key, missing) for f in flat.values()]
        marks = [json.dumps(v, sort_keys=True, default=str) if v is not missing else None for v in values]
        if len(set(marks)) > 1:
            rows.append([key] + [NONE if v is missing else fmt(v) for v in values])
    return ["key", *flat], rows


def config_diff_markdown(configs: Mapping[str, Mapping]) -> str:
    if len(configs) < 2:
        return "_Select two or more runs to compare their configs._"
    headers, rows = config_diff(configs)
    if not rows:
        return "_The selected runs have identical configs._"
    return (f"**Config keys that differ** ({len(rows)})\n\n"
            + md_table([esc(h) for h in headers], ([f"`{r[0]}`"] + [esc(c) for c in r[1:]] for r in rows)))


# ---- one record ----------------------------------------------------------------------------

def run_markdown(run: Mapping) -> str:
    """A run's page: who and where, failure with its evidence, anomalies, summary, config, notes."""
    rid = run["id"]
    status = run.get("status") or NONE
    badge = f"**{esc(status)}**" if status not in FAILED_STATUSES else f"**⚠ {esc(status)}**"
    lines = [f"### Run {esc(run.get('name') or rid)}", "",
             f"id `{rid}` · project **{esc(run.get('project'))}** · status {badge}"]
    src = run.get("source") or {}
    when = " → ".join(fmt(run[k]) for k in ("started_at", "ended_at") if run.get(k))
    meta = [f"source {esc(src.get('kind'))} `{src.get('uri')}`" if src.get("uri") else "",
            f"time {esc(when)}" if when else "",
            f"parent {link('run', run['parent'])}" if run.get("parent") else "",
            f"hypothesis {link('hypothesis', run['hypothesis'])}" if run.get("hypothesis") else ""]
    if any(meta):
        lines.append(" · ".join(m for m in meta if m))
    scale = run.get("scale") or {}
    if any(scale.get(k) is not None for k in SCALE_KEYS):
        lines.append("scale " + " · ".join(f"{k} {fmt(scale.get(k), size=True)}" for k in SCALE_KEYS
                                           if scale.get(k) is not None))
    if run.get("tags"):
        lines.append("tags " + " ".join(f"`{esc(t)}`" for t in run["tags"]))
    for f in run.get("failures") or []:
        lines += ["", failure_summary(f, with_run=False)]
        if f.get("evidence"):
            lines += ["", code_block(f["evidence"], "text")]
    anomalies = run.get("anomalies") or []
    if anomalies:
        lines += ["", "#### Anomalies",
                  md_table(["kind", "metric", "step", "value", "evidence"],
                           ([esc(a["kind"]), esc(a.get("key")), fmt(a.get("step")), fmt(a.get("value")),
                             esc(a.get("evidence") or "")[:200]] for a in anomalies))]
    stats = run.get("stats") or {}
    summary = run.get("summary") or {}
    if summary:
        lines += ["", "#### Summary",
                  md_table(["metric", "final", "best", "at step"],
                           ([f"`{esc(k)}`", fmt(v), fmt((stats.get(k) or {}).get("best")),
                             fmt((stats.get(k) or {}).get("best_step"))] for k, v in summary.items()))]
    flat = flatten(run.get("config") or {})
    if flat:
        lines += ["", "#### Config", md_table(["key", "value"], ([f"`{k}`", esc(fmt(v))] for k, v in flat.items()))]
    if run.get("ablations"):
        lines += ["", "#### Ablations it belongs to"]
        lines += [f"- {link('ablation', a['id'], a['factor'])} on {esc(a.get('metric') or 'no metric')}"
                  for a in run["ablations"]]
    if run.get("notes"):
        lines += ["", "#### Notes", "", blockquote(run["notes"])]
    return "\n".join(lines)


def failure_summary(f: Mapping, with_run: bool = True) -> str:
    at = f" at step {fmt(f['step'])}" if f.get("step") is not None else ""
    who = f" in run {link('run', f['run_id'], f.get('run_name'))}" if with_run and f.get("run_id") else ""
    message = f": {esc(f['message'])}" if f.get("message") else ""
    origin = f" _(found in the {esc(f['origin'])})_" if f.get("origin") in ("log", "curve") else ""
    return f"**Failure — {esc(f['kind'])}**{at}{who}{message}{origin}"


def failure_markdown(f: Mapping) -> str:
    lines = [f"### Failure {esc(f['id'])}: {esc(f['kind'])}", "", failure_summary(f),
             "", f"project **{esc(f.get('project'))}** · run status **{esc(f.get('run_status'))}**"]
    if f.get("evidence"):
        lines += ["", "Evidence (the log lines the classifier matched):", "", code_block(f["evidence"], "text")]
    return "\n".join(lines)


def note_markdown(note: Mapping) -> str:
    src = note.get("source") or {}
    lines = [f"### Note: {esc(note.get('title') or note['id'])}", "",
             f"id `{note['id']}` · project **{esc(note.get('project'))}** · part {note.get('chunk', 0) + 1}"
             f" of `{src.get('uri') or 'unknown source'}`" + (f" ({esc(src['kind'])})" if src.get("kind") else "")]
    if note.get("mentions"):
        lines.append("mentions " + ", ".join(link("run", r) for r in note["mentions"]))
    lines += ["", blockquote(note.get("text") or "")]
    return "\n".join(lines)


def ablation_markdown(a: Mapping) -> str:
    effect = a.get("effect") or {}
    sigma = effect.get("seed_sigma")
    lines = [f"### Ablation: {esc(a['factor'])}", "",
             f"id `{a['id']}` · project **{esc(a.get('project'))}** · metric `{esc(a.get('metric') or NONE)}`"
             f" · baseline {link('run', a['baseline_run'])}"]
    rows = []
    for v in a.get("variants") or []:
        runs = v.get("runs") or [v.get("run")]
        rows.append([esc(fmt(v.get("value"))) + (" (baseline)" if v.get("baseline") else ""),
                     fmt(v.get("metric")), NONE if v.get("baseline") else _signed(v.get("delta")),
                     fmt(v.get("seeds")), _verdict(v, sigma),
                     ", ".join(link("run", r) for r in runs if r)])
    lines += ["", md_table([esc(a["factor"]), esc(a.get("metric") or "metric"), "Δ vs baseline", "seeds",
                            "verdict", "runs"], rows)]
    said = []
    if effect.get("best"):
        said.append(f"best: {link('run', effect['best'])}")
    if sigma is not None:
        said.append(f"seed noise σ = {fmt(sigma)} (an effect counts when |Δ| > 2σ)")
    else:
        said.append("no seed repeats: the noise floor is unknown, so no effect is judged")
    lines += ["", " · ".join(said)]
    return "\n".join(lines)


def _signed(v: Any) -> str:
    return NONE if v is None else f"{v:+.4g}"


def _verdict(variant: Mapping, sigma: float | None) -> str:
    if variant.get("baseline"):
        return NONE
    clears = variant.get("exceeds_seed_spread")
    if clears is None:
        return "not judged"
    if not clears:
        return "within seed noise"
    # the direction only: whether lower is better depends on the metric, which the reader knows
    return f"{'lower' if (variant.get('delta') or 0) < 0 else 'higher'}, beyond seed noise"


def blockquote(text: str) -> str:
    """Free text (a note, a run's notes) quoted. Notes are Markdown, so their emphasis and lists
    render; raw HTML is not let in (`<` shown as written)."""
    lines = str(text).strip().replace("<", "&lt;").splitlines()
    return "\n".join(f"> {ln}".rstrip() for ln in lines) or f"> {NONE}"


def record_markdown(kind: str, record: Mapping) -> str:
    return {"run": run_markdown, "note": note_markdown, "ablation": ablation_markdown,
            "failure": failure_markdown}[kind](record)
