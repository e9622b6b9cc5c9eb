"""The Failures tab: how runs failed (oom, nccl_timeout, hardware, diverged, killed, exception, ...)
and what their curves showed (loss spikes, plateaus, divergence), grouped by kind with counts,
each row linking to its run, with the step and the log lines the classifier matched.

    failures_markdown(kb.failures(limit=500))     # what the tab shows, testable without a browser
"""
from __future__ import annotations

import html
from itertools import groupby
from typing import Mapping, Sequence

import gradio as gr

from kb.ui.context import in_arrival_order
from kb.ui.records import NONE, esc, fmt, link, md_table

ID, TITLE = "failures", "Failures"
SHOWN = 500                # rows read per list; the counts cover every run
EVIDENCE_LINES = 8
EVIDENCE_CHARS = 160
ALL = "all kinds"


def counts_markdown(counts: Mapping[str, int], title: str) -> str:
    """`title` and its total, then a table of the count of each kind, the most frequent first."""
    total = sum(counts.values())
    table = md_table(["kind", "count"], ([esc(k.replace("_", " ")), str(n)] for k, n in counts.items()))
    return f"**{title} · {total}**\n\n" + (table or "_none_")


def evidence_cell(evidence: str) -> str:
    """A failure's evidence lines in one table cell: monospace, one line each, the last few kept."""
    lines = [ln.rstrip() for ln in str(evidence or "").splitlines() if ln.strip()][-EVIDENCE_LINES:]
    if not lines:
        return NONE
    shown = [ln if len(ln) <= EVIDENCE_CHARS else ln[:EVIDENCE_CHARS - 1] + "…" for ln in lines]
    # escaped for HTML and for Markdown's table pipes; <code> keeps the log's spacing readable
    return "<br>".join(f"<code>{html.escape(ln).replace('|', '&#124;')}</code>" for ln in shown)


def failures_markdown(failures: Sequence[Mapping]) -> str:
    """A section per failure kind (most runs first): run link, project, step, message, evidence."""
    if not failures:
        return "_No failures recorded: every run ended normally, or none reported how it ended._"
    groups = _grouped(failures)
    out = []
    for kind, rows in groups:
        out += [f"#### {esc(kind)} · {len(rows)} run{'s' if len(rows) != 1 else ''}", "",
                md_table(["run", "project", "step", "message", "evidence"],
                         ([link("run", f["run_id"], f.get("run_name")), esc(f.get("project")), fmt(f.get("step")),
                           esc(f.get("message") or NONE)[:200], evidence_cell(f.get("evidence"))]
                          for f in rows)), ""]
    return "\n".join(out)


def anomalies_markdown(anomalies: Sequence[Mapping]) -> str:
    if not anomalies:
        return "_No anomalies found on any curve._"
    out = []
    for kind, rows in _grouped(anomalies):
        out += [f"#### {esc(kind.replace('_', ' '))} · {len(rows)}", "",
                md_table(["run", "project", "metric", "step", "value", "score", "evidence"],
                         ([link("run", a["run_id"], a.get("run_name")), esc(a.get("project")), f"`{esc(a.get('key'))}`",
                           fmt(a.get("step")), fmt(a.get("value")), fmt(a.get("score")),
                           esc(a.get("evidence") or NONE)[:200]] for a in rows)), ""]
    return "\n".join(out)


def _grouped(rows: Sequence[Mapping]) -> list[tuple[str, list]]:
    ordered = sorted(rows, key=lambda r: r["kind"])
    groups = [(k, list(g)) for k, g in groupby(ordered, key=lambda r: r["kind"])]
    return sorted(groups, key=lambda kg: (-len(kg[1]), kg[0]))


def build(ui) -> None:
    gr.Markdown("How runs failed and what their curves showed. Click a run to open it in the Runs tab.")
    with gr.Row():
        kind = gr.Dropdown(label="Kind", choices=[ALL], value=ALL, scale=3, elem_id="kb-failures-kind")
        project = gr.Textbox(label="Project", placeholder="all projects", scale=3)
        refresh = gr.Button("Refresh", scale=0, min_width=100)
    with gr.Row():
        failure_counts = gr.Markdown(elem_id="kb-failures-counts")
        anomaly_counts = gr.Markdown(elem_id="kb-anomalies-counts")
    with gr.Tabs():
        with gr.Tab("Failures"):
            failures = gr.Markdown(elem_id="kb-failures-list")
        with gr.Tab("Anomalies"):
            anomalies = gr.Markdown(elem_id="kb-anomalies-list")

    def load(chosen: str, proj: str):
        proj = (proj or "").strip() or None
        found = ui.kb.failure_counts(project=proj)
        kinds = list(found["failures"]) + [k for k in found["anomalies"] if k not in found["failures"]]
        chosen = chosen if chosen in kinds else ALL
        only = None if chosen == ALL else chosen
        fails = ui.kb.failures(kind=only, project=proj, limit=SHOWN) if only is None or only in found["failures"] else []
        anoms = ui.kb.anomalies(kind=only, project=proj, limit=SHOWN) if only is None or only in found["anomalies"] else []
        return (gr.Dropdown(choices=[ALL] + kinds, value=chosen), counts_markdown(found["failures"], "Failures"),
                counts_markdown(found["anomalies"], "Anomalies"), failures_markdown(fails), anomalies_markdown(anoms))

    outputs = [kind, failure_counts, anomaly_counts, failures, anomalies]
    in_order = in_arrival_order("failures-listing")      # a choice made during the page-load listing wins
    refresh.click(load, [kind, project], outputs, **in_order)
    kind.input(load, [kind, project], outputs, **in_order)
    project.submit(load, [kind, project], outputs, **in_order)
    gr.on(None, lambda: load(ALL, ""), None, outputs, **in_order)       # on page load
