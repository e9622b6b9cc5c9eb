"""The Jobs tab: the queue as it runs. Every job's status and progress (step of max_steps, its
latest losses), refreshed every POLL_S seconds; one job opened shows its loss curves (live while
it trains: the bounded curve runner.execute keeps in its progress; its run's full curves once
it has one), a link to its run, a cancel button, and for a hypothesis's job the verdict once
its jobs are done and the hypothesis's report.

    /ui/?job=job-0123456789ab               # opens that job here

The layout helpers (`job_rows`, `job_markdown`, `job_curves`, `curve_figure`) are plain
functions of the API's dicts, tested without a browser.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import gradio as gr

from kb.errors import KBError
from kb.ui.hypotheses import cite, linked, result_markdown
from kb.ui.records import problem

ID, TITLE = "jobs", "Jobs"
STATUSES = ("all", "queued", "running", "succeeded", "failed", "cancelled")
FINISHED = ("succeeded", "failed", "cancelled")
POLL_S = 2.0
COLUMNS = ["id", "status", "name", "hypothesis", "progress", "val/loss", "run", "attempts", "error"]
DATATYPES = ["str", "str", "str", "markdown", "str", "str", "markdown", "number", "str"]
MARKERS_UP_TO = 250           # a curve with more points is drawn as a line only
FIGURE = re.compile(r"^!\[[^\]]*\]\([^)]*\)\s*$", re.M)    # a report's PNG, which the page cannot reach


# ---- layout -------------------------------------------------------------------------------------

def _num(v) -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return "-"
    return f"{v:,.0f}" if abs(v) >= 1e4 else f"{v:.4g}"         # throughput reads as 13,590, not 1.359e+04


def progress_text(job: dict) -> str:
    p = job.get("progress") or {}
    if "step" not in p:
        return "-"
    return f"{p['step']} / {p['max_steps']}" if p.get("max_steps") else str(p["step"])


def job_rows(jobs: list[dict]) -> list[list]:
    """The queue, newest first."""
    rows = []
    for j in reversed(jobs):
        metrics = (j.get("progress") or {}).get("metrics") or {}
        rows.append([j["id"], j["status"] + (" (cancel asked)" if j.get("cancel_requested") and j["status"] == "running"
                                              else ""),
                     j.get("name") or "-", cite(j["hypothesis"], "hypothesis") if j.get("hypothesis") else "",
                     progress_text(j), _num(metrics.get("val/loss")), cite(j["run"], "run") if j.get("run") else "",
                     j.get("attempts", 0), (j.get("error") or "")[:120]])
    return rows


def job_markdown(job: dict) -> str:
    p = job.get("progress") or {}
    out = [f"### {job['id']} · **{job['status']}**" + (" (cancel requested)" if job.get("cancel_requested")
                                                         and job["status"] not in FINISHED else ""),
           " · ".join(x for x in (job.get("name"), f"project {job.get('project') or '-'}", f"backend {job['backend']}",
                                  f"attempt {job['attempts']} of {job.get('max_attempts', '?')}") if x)]
    if "step" in p:
        share = f" ({p['step'] / p['max_steps']:.0%})" if p.get("max_steps") else ""
        metrics = p.get("metrics") or {}
        shown = ", ".join(f"{k} {_num(v)}" for k, v in metrics.items())
        out.append(f"**Progress:** step {p['step']}" + (f" of {p['max_steps']}{share}" if p.get("max_steps") else "")
                   + (f" — {shown}" if shown else ""))
    if job.get("run"):
        out.append(f"**Run:** {cite(job['run'], 'run')}")
    if job.get("hypothesis"):
        out.append(f"**Hypothesis:** {cite(job['hypothesis'], 'hypothesis')}")
    if job.get("error"):
        out.append(f"**Error:** {job['error']}")
    times = [f"{k} {job[k + '_at'][:19].replace('T', ' ')}" for k in ("created", "started", "finished")
             if job.get(k + "_at")]
    if times:
        out.append(" · ".join(times) + " (UTC)")
    return "\n\n".join(out)


def _is_loss(key: str) -> bool:
    return "loss" in key


def job_curves(job: dict, run=None) -> dict[str, list[list]]:
    """{key: [[step, value], ...]} of a job's losses: its run's full curves once it has a run
    (`run`: a kb.runs.RunDetail), else the live curve of its progress."""
    if run is not None:
        return {k: [p[:2] for p in pts] for k, pts in run.metrics.items() if _is_loss(k)}
    return {k: v for k, v in ((job.get("progress") or {}).get("curve") or {}).items() if _is_loss(k)}


def curve_figure(curves: dict[str, list[list]], title: str = ""):
    """Loss against step, one trace per key; the mean val/loss and train/loss drawn boldest."""
    import plotly.graph_objects as go
    fig = go.Figure()
    order = sorted(curves, key=lambda k: (k not in ("val/loss", "train/loss"), k))
    for key in order:
        pts = curves[key]
        x = [p[0] for p in pts]
        y = [p[1] if isinstance(p[1], (int, float)) and math.isfinite(p[1]) else None for p in pts]
        main = key in ("val/loss", "train/loss")
        fig.add_trace(go.Scatter(x=x, y=y, name=key, mode="lines+markers" if len(pts) <= MARKERS_UP_TO else "lines",
                                 line={"width": 2 if main else 1, "dash": None if main else "dot"},
                                 marker={"size": 4}))
    if not curves:
        fig.add_annotation(text="no curve yet: the first eval has not come", showarrow=False,
                           xref="paper", yref="paper", x=0.5, y=0.5)
    fig.update_layout(title=title, xaxis_title="step", yaxis_title="loss", template="plotly_white",
                      height=380, margin={"l": 50, "r": 20, "t": 40, "b": 40})
    return fig


def report_markdown(text: str) -> str:
    """A written report for the page: citations as links, its PNG figure (a file beside the
    Markdown, which the page cannot load) left out."""
    return linked(FIGURE.sub("", text))


def verdict_markdown(h: dict, jobs: list[dict]) -> str:
    """Where a hypothesis's jobs stand, and its verdict once the last one has finished."""
    if h["status"] == "done" and h.get("result"):
        return f"{cite(h['id'], 'hypothesis')} **done**: {h['title']}\n\n" + result_markdown(h["result"])
    done = sum(j["status"] in FINISHED for j in jobs)
    return (f"{cite(h['id'], 'hypothesis')} is **{h['status']}**: {done} of {len(jobs)} job(s) finished; "
            "its verdict comes when the last one does.")


# ---- the tab ------------------------------------------------------------------------------------

def build(ui) -> None:
    kb = ui.kb

    def listed(filt: str) -> list[dict]:
        return kb.jobs(status=None if filt == "all" else filt)

    def look(ref: str):
        """(the job or the error's Markdown, a signature that changes when what is drawn would)."""
        try:
            job = kb.job(ref)
            h = kb.hypothesis(job["hypothesis"]) if job.get("hypothesis") else None
        except KBError as exc:
            return problem(exc), [ref, "error", str(exc)]
        return job, [ref, job["status"], (job.get("progress") or {}).get("step"), job.get("run"),
                     h and h["status"]]

    def drawn(job):
        """(detail, figure, verdict, hypothesis) of a job, or of the error looking it up."""
        if isinstance(job, str):
            return job, None, "", ""
        run = None
        if job.get("run"):
            try:
                run = kb.run(job["run"])
            except KBError:
                run = None
        verdict = ""
        if job.get("hypothesis"):
            try:
                h = kb.hypothesis(job["hypothesis"])
                verdict = verdict_markdown(h, kb.jobs(hypothesis=h["id"]))
            except KBError as exc:
                verdict = problem(exc)
        step = (job.get("progress") or {}).get("step", 0)
        title = f"{job.get('name') or job['id']}: " + ("its run's curves" if run is not None else f"live, step {step}")
        return job_markdown(job), curve_figure(job_curves(job, run), title), verdict, job.get("hypothesis") or ""

    def opened(ref: str):
        """(detail, figure, verdict, hypothesis, signature) of the job `ref`."""
        ref = (ref or "").strip()
        if not ref:
            return "Select a job in the table (or open `?job=ID`).", None, "", "", None
        job, signature = look(ref)
        return (*drawn(job), signature)

    with gr.Row():
        status = gr.Dropdown(list(STATUSES), value="all", label="Status", scale=1)
        refresh = gr.Button("Refresh", scale=0)
        live = gr.Checkbox(value=True, label=f"Follow live (every {POLL_S:g} s)", scale=1)
    rows = gr.Dataframe(headers=COLUMNS, datatype=DATATYPES, value=lambda: job_rows(listed("all")),
                        interactive=False, wrap=True, label="Jobs, newest first (select one to follow it)",
                        elem_id="jobs-table")
    chosen = gr.Textbox(label="Job", placeholder="job-…", elem_id="job-id")
    with gr.Row():
        with gr.Column(scale=2):
            shown = gr.Markdown(opened("")[0], elem_id="job-detail")
            cancel = gr.Button("Cancel this job", variant="stop", elem_id="job-cancel")
            said = gr.Markdown(elem_id="job-message")
        with gr.Column(scale=3):
            plot = gr.Plot(label="Loss", elem_id="job-curve")
    gr.Markdown("#### Verdict and report")
    verdict = gr.Markdown(elem_id="job-verdict")
    with gr.Row():
        hyp = gr.Textbox(label="Hypothesis", placeholder="hyp-…", scale=3, elem_id="job-hypothesis")
        write = gr.Button("Write its report", scale=1, elem_id="job-report-button")
    report = gr.Markdown(elem_id="job-report")
    seen = gr.State({})
    timer = gr.Timer(POLL_S)

    def selected(data, evt: gr.SelectData):
        row = evt.row_value if evt.row_value is not None else data.values.tolist()[evt.index[0]]
        return row[0]

    def show(ref: str, known: dict):
        detail, figure, text, h, signature = opened(ref)
        return detail, figure, text, h, dict(known or {}, job=signature)

    def tick(filt: str, ref: str, known: dict, follow: bool):
        """Redraw what changed since the last look; gr.skip() leaves the rest as it is on the page."""
        if not follow:
            return (gr.skip(),) * 6
        known = dict(known or {})
        jobs = listed(filt)
        table_sig = [[j["id"], j["status"], (j.get("progress") or {}).get("step"), j.get("run")] for j in jobs]
        table = gr.skip()
        if table_sig != known.get("table"):
            table, known["table"] = job_rows(jobs), table_sig
        outs = (gr.skip(),) * 4
        if (ref or "").strip():
            job, signature = look(ref.strip())
            if signature != known.get("job"):
                outs, known["job"] = drawn(job), signature
        return (table, *outs, known)

    def cancelled(ref: str, known: dict):
        ref = (ref or "").strip()
        if not ref:
            return "Select a job first.", *(gr.skip(),) * 5
        try:
            job = kb.cancel(ref)
        except KBError as exc:
            return problem(exc), *(gr.skip(),) * 5
        said_text = (f"{cite(ref, 'job')} cancelled." if job["status"] == "cancelled"
                     else f"{cite(ref, 'job')}: asked to stop; it stops at its next step.")
        return (said_text, *show(ref, known))

    def reported(ref: str):
        ref = (ref or "").strip()
        if not ref:
            return "Name a hypothesis (a job of one fills it in)."
        try:
            written = kb.report(ref=ref, out=str(Path(kb.settings.home) / "reports"))
            text = Path(written.markdown).read_text(encoding="utf-8")
        except (KBError, OSError) as exc:           # OSError: a home this server cannot write to
            return problem(exc)
        return report_markdown(text) + f"\n\n*Written to `{written.markdown}`.*"

    detail_outputs = [shown, plot, verdict, hyp, seen]
    status.change(lambda f: job_rows(listed(f)), status, rows)
    refresh.click(lambda f: job_rows(listed(f)), status, rows)
    rows.select(selected, rows, chosen)
    chosen.change(show, [chosen, seen], detail_outputs)
    timer.tick(tick, [status, chosen, seen, live], [rows, *detail_outputs], show_progress="hidden")
    cancel.click(cancelled, [chosen, seen], [said, *detail_outputs])
    write.click(reported, hyp, report)

    def linked_job(ref: str) -> dict:
        detail, figure, text, h, _ = opened(ref)
        return {chosen: ref, shown: detail, plot: figure, verdict: text, hyp: h}

    ui.link("job", ID, linked_job, [chosen, shown, plot, verdict, hyp])
