"""The Runs tab: filter runs with the query language, compare their curves and configs, open one.

    status = 'diverged' and config.optim.lr > 1e-3        (the Filter box; `kb runs --where`)
    -summary.val/loss                                      (Sort by)

The table sorts by any column (click its header); the first runs it shows are selected for the
plot, one line per run, with W&B's EMA smoothing, log axes, anomalies marked where the curve
had them and a dashed line where a run diverged. Under it, only the config keys that differ
between the selected runs. A link ?run=ID (a chat citation) opens that run's page at the top of
this tab; ?note=, ?ablation= and ?failure= open those records in the same panel.
"""
from __future__ import annotations

import logging
from typing import Mapping

import gradio as gr

from kb.errors import KBError, NotFound, QueryError
from kb.ui.context import in_arrival_order
from kb.ui.curves import Mark, Series, curves_figure
from kb.ui.records import config_diff_markdown, esc, problem_markdown, record_markdown, runs_table, table_metrics
from kb.vocab import metric_name

log = logging.getLogger(__name__)

ID, TITLE = "runs", "Runs"
LIMIT = 200
SHOWN_FIRST = 5           # runs selected for the plot when a filter is applied
MAX_SELECTED = 12         # lines one plot can tell apart
RECORD_KINDS = ("run", "note", "ablation", "failure")


def query_error_markdown(message: str) -> str:
    return problem_markdown("Query error", message)


def run_label(run: Mapping) -> str:
    name = run.get("name") or run["id"]
    return run["id"] if name == run["id"] else f"{name} ({run['id']})"


def pick_metric(curve_keys: list[str], preferred: list[str], current: str | None = None) -> str | None:
    """The metric to plot: the one chosen if the runs still have it, else the first of the main
    metrics (val/loss first) that some run logged, else the first curve."""
    if current and current in curve_keys:
        return current
    for canon in preferred:
        for key in curve_keys:
            if key == canon or metric_name(key) == canon:
                return key
    return curve_keys[0] if curve_keys else None


def same_metric(keys: list[str], chosen: str) -> str | None:
    """The key a run logged `chosen` under: the same key, else one the vocabulary names alike
    (a run's eval_loss beside another's val/loss)."""
    if chosen in keys:
        return chosen
    canon = metric_name(chosen)
    return next((k for k in keys if canon and metric_name(k) == canon), None)


def series_of(run: Mapping, key: str, label: str | None = None) -> Series:
    """A run's curve `key` with its anomalies on that curve and the step where it diverged."""
    marks = [Mark(a["step"], a["kind"], a.get("evidence") or "", a.get("value"))
             for a in run.get("anomalies") or [] if a.get("key") == key and a.get("step") is not None]
    diverged = None
    for f in run.get("failures") or []:
        if f.get("step") is None:
            continue
        if f["kind"] == "diverged":
            diverged = f["step"]
        else:
            marks.append(Mark(f["step"], f["kind"], f.get("message") or f["kind"]))
    return Series(label or run_label(run), (run.get("metrics") or {}).get(key) or [], marks, diverged, run["id"])


def run_figure(run: Mapping):
    """A run's own page plot: its loss curves (every curve if it logged no loss), anomalies marked."""
    keys = list(run.get("metrics") or {})
    losses = [k for k in keys if "loss" in k.lower() and "scale" not in k.lower()] or keys[:4]
    if not losses:
        return None
    series = [series_of(run, k, label=k) for k in losses]
    for s in series[1:]:
        s.diverged_at = None          # one line for the run, on its first curve
    return curves_figure(series, "loss" if "loss" in losses[0] else losses[0],
                         title=f"{run.get('name') or run['id']}: curves")


def build(ui) -> None:
    known = gr.State({})      # id -> {"name", "curves", "canonical", "config"} of the rows in the table

    with gr.Column(visible=False, variant="panel", elem_id="kb-record") as panel:
        with gr.Row():
            record_md = gr.Markdown(elem_id="kb-record-body")
            close = gr.Button("Close", size="sm", scale=0, min_width=80)
        record_plot = gr.Plot(visible=False, show_label=False)

    with gr.Row():
        where = gr.Textbox(label="Filter", placeholder="status = 'diverged' and config.optim.lr > 1e-3",
                           scale=6, elem_id="kb-runs-where")
        sort = gr.Textbox(label="Sort by", placeholder="-summary.val/loss", scale=2, elem_id="kb-runs-sort")
        limit = gr.Number(label="Limit", value=LIMIT, precision=0, minimum=1, maximum=100_000, scale=1,
                          min_width=90)
        apply = gr.Button("Apply", variant="primary", scale=0, min_width=100)
    problem = gr.Markdown(visible=False, elem_id="kb-runs-error")
    count = gr.Markdown()
    table = gr.Dataframe(interactive=False, max_height=420, show_search="search", wrap=False,
                         label="Runs (click a column header to sort, a row to open the run)",
                         elem_id="kb-runs-table")

    gr.Markdown("#### Compare")
    with gr.Row(equal_height=True):
        # custom values allowed: a selection made from the previous table may reach `compare` after
        # a new filter replaced the choices, and Gradio would refuse it; compare skips unknown ids
        selected = gr.Dropdown(label="Runs", multiselect=True, choices=[], max_choices=MAX_SELECTED, scale=5,
                               allow_custom_value=True, elem_id="kb-runs-selected")
        metric = gr.Dropdown(label="Metric", choices=[], scale=2, allow_custom_value=True, elem_id="kb-runs-metric")
    with gr.Row(equal_height=True):
        smoothing = gr.Slider(0, 0.99, value=0, step=0.01, label="Smoothing (EMA)", scale=4)
        log_y = gr.Checkbox(label="Log y", value=False, scale=1, min_width=90)
        log_x = gr.Checkbox(label="Log x", value=False, scale=1, min_width=90)
    plot = gr.Plot(show_label=False, elem_id="kb-runs-plot")
    diff = gr.Markdown(elem_id="kb-runs-diff")

    # ---- events ------------------------------------------------------------------------

    def search(where_text: str, sort_text: str, n):
        try:
            runs = ui.kb.runs(where=(where_text or "").strip() or None, sort=(sort_text or "").strip() or None,
                              limit=int(n) if n else LIMIT)
        except QueryError as exc:
            return {problem: gr.Markdown(query_error_markdown(str(exc)), visible=True)}
        except KBError as exc:
            return {problem: gr.Markdown(f"**Could not list runs:** {esc(exc)}", visible=True)}
        runs = [r.model_dump(mode="json") for r in runs]
        info = {r["id"]: {"name": r.get("name"), "curves": list(r.get("stats") or {}),
                          "canonical": r.get("canonical") or {}, "config": r.get("config") or {}} for r in runs}
        shown = f"**{len(runs)}** run{'s' if len(runs) != 1 else ''}"
        if n and len(runs) == int(n):
            shown += f" (the first {len(runs)}: raise the limit to see more)"
        return {problem: gr.Markdown(visible=False), count: shown, table: runs_table(runs), known: info,
                selected: gr.Dropdown(choices=[(run_label(r), r["id"]) for r in runs],
                                      value=[r["id"] for r in runs[:SHOWN_FIRST]])}

    def compare(ids: list[str], info: dict, current: str | None, smooth: float, ly: bool, lx: bool):
        ids = [i for i in ids or [] if i in info]
        keys = list(dict.fromkeys(k for i in ids for k in info[i]["curves"]))
        preferred = table_metrics([{"canonical": info[i]["canonical"]} for i in ids]) + ["val/loss", "train/loss"]
        chosen = pick_metric(keys, preferred, current)
        configs = {run_label({"id": i, "name": info[i]["name"]}): info[i]["config"] for i in ids}
        return (gr.Dropdown(choices=keys, value=chosen), draw(ids, chosen, smooth, ly, lx),
                config_diff_markdown(configs) if ids else "")

    def draw(ids: list[str], chosen: str | None, smooth: float, ly: bool, lx: bool):
        if not ids or not chosen:
            return None
        series = []
        for rid in ids:
            try:
                run = ui.kb.run(rid).as_dict()
            except NotFound:           # deleted since the table was read
                continue
            key = same_metric(list(run.get("metrics") or {}), chosen)
            if key is not None:
                series.append(series_of(run, key))
        return curves_figure(series, chosen, log_x=lx, log_y=ly, smoothing=smooth or 0.0)

    def redraw(ids, chosen, smooth, ly, lx):
        return draw(ids or [], chosen, smooth, ly, lx)

    def show(kind: str, ref: str) -> dict:
        try:
            record = ui.kb.record(kind, ref)
        except KBError as exc:
            return {panel: gr.Column(visible=True), record_md: f"**Not found:** {esc(exc)}",
                    record_plot: gr.Plot(visible=False)}
        figure = run_figure(record) if kind == "run" else None
        return {panel: gr.Column(visible=True), record_md: record_markdown(kind, record),
                record_plot: gr.Plot(figure, visible=figure is not None)}

    def open_row(evt: gr.SelectData):
        row = evt.row_value or []
        return show("run", str(row[0])) if row else {}

    listing = [problem, count, table, known, selected]
    in_order = in_arrival_order(f"{ID}-listing")      # a filter applied during the page-load listing wins
    apply.click(search, [where, sort, limit], listing, **in_order)
    where.submit(search, [where, sort, limit], listing, **in_order)
    sort.submit(search, [where, sort, limit], listing, **in_order)
    gr.on(None, lambda: search("", "", LIMIT), None, listing, **in_order)     # on page load
    selected.change(compare, [selected, known, metric, smoothing, log_y, log_x], [metric, plot, diff])
    gr.on([metric.input, smoothing.release, log_y.input, log_x.input], redraw,
          [selected, metric, smoothing, log_y, log_x], plot)
    table.select(open_row, None, [panel, record_md, record_plot], scroll_to_output=True)
    close.click(lambda: gr.Column(visible=False), None, panel)
    for kind in RECORD_KINDS:
        ui.link(kind, ID, lambda ref, kind=kind: show(kind, ref), [panel, record_md, record_plot])
