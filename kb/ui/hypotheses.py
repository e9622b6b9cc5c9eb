"""The Hypotheses tab: the review queue. Proposed hypotheses in a table; one opened shows its
rationale, the change against its baseline's config, evidence (each a link to its record), the
predicted effect with its interval, risks and plan; approve (which queues its jobs, as
`kb approve` then `kb submit` would) or reject it with a reason; propose new ones.

    /ui/?hypothesis=hyp-1a2b3c4d5e          # opens that hypothesis here

The layout helpers (`hypothesis_rows`, `hypothesis_markdown`, `result_markdown`, `linked`) are
plain functions of the API's dicts, tested without a browser.
"""
from __future__ import annotations

import getpass
import json
import os
import re

import gradio as gr

from kb.errors import KBError, NotFound
from kb.fields import lookup
from kb.hypotheses import split_key
from kb.ui.context import in_arrival_order
from kb.ui.records import link, problem

ID, TITLE = "hypotheses", "Hypotheses"
STATUSES = ("proposed", "approved", "rejected", "running", "done", "all")
BACKENDS = ("local", "inline", "ray", "slurm")          # runner.backends registers these
COLUMNS = ["id", "status", "project", "source", "predicted", "title"]
PREFIXES = {"abl-": "ablation", "hyp-": "hypothesis", "job-": "job", "note-": "note"}
CITATION = re.compile(r"(?<![!\]])\[([^\[\]\s]+)\](?!\()")     # [run-id], not [text](url) nor ![img](x)


# ---- links --------------------------------------------------------------------------------------

def kind_of(ref: str) -> str:
    """The kind of record an id names, by the prefixes the store gives ids; a run otherwise
    (run ids are whatever the training named them)."""
    return next((kind for prefix, kind in PREFIXES.items() if ref.startswith(prefix)), "run")


def cite(ref: str, kind: str | None = None) -> str:
    """A Markdown link to a record's page: [run-1](?run=run-1)."""
    return link(kind or kind_of(ref), ref)


def linked(text: str) -> str:
    """Text whose citations ([run-1], [abl-lr-...]) are links to their records."""
    return CITATION.sub(lambda m: cite(m.group(1)), text)


# ---- layout -------------------------------------------------------------------------------------

def _g(v) -> str:
    return f"{v:+.4g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def predicted_text(p: dict | None) -> str:
    """`val/loss -0.021 [-0.034, -0.008]` (95% when the level is known)."""
    p = p or {}
    if not isinstance(p.get("delta"), (int, float)):
        return "-"
    text = f"{p.get('metric', '')} {_g(p['delta'])}".strip()
    interval = p.get("interval")
    if isinstance(interval, (list, tuple)) and len(interval) == 2:
        level = f"{p['level']:.0%} " if isinstance(p.get("level"), (int, float)) else ""
        text += f" ({level}interval {_g(interval[0])} to {_g(interval[1])})"
    return text


def hypothesis_rows(hypotheses: list[dict]) -> list[list]:
    return [[h["id"], h["status"], h.get("project") or "-", h.get("source") or "-",
             predicted_text(h.get("predicted")), h["title"]] for h in hypotheses]


_ABSENT = object()


def _value(v) -> str:
    return "(absent)" if v is _ABSENT else f"`{json.dumps(v)}`"


def change_rows(change: dict, baseline_config: dict | None) -> list[tuple[str, str, str]]:
    """(key, the baseline's value, the proposed value) for each changed key."""
    rows = []
    for key, new in change.items():
        old = "?"
        if baseline_config is not None:
            try:
                found, v = lookup(baseline_config, split_key(key))
            except KBError:
                found, v = False, None
            old = _value(v if found else _ABSENT)
        rows.append((key, old, _value(new)))
    return rows


def hypothesis_markdown(h: dict, baseline_config: dict | None = None, jobs: list[dict] = ()) -> str:
    """One hypothesis for review: what, why, the change as a diff, evidence links, predicted
    effect, risks, plan, the decision taken and, once run, its verdict."""
    out = [f"### {h['title']}",
           f"{cite(h['id'], 'hypothesis')} · status **{h['status']}** · project {h.get('project') or '-'}"
           f" · source {h.get('source') or '-'}" + (f" · goal: {h['goal']}" if h.get("goal") else "")]
    if h.get("rationale"):
        out.append(f"**Rationale.** {linked(h['rationale'])}")
    base = h.get("baseline_run")
    out.append(f"**Change** on baseline {cite(base, 'run') if base else '(none named)'}:")
    out.append("| key | baseline | proposed |\n|---|---|---|\n"
               + "\n".join(f"| `{k}` | {old} | {new} |" for k, old, new in change_rows(h["change"], baseline_config)))
    evidence = h.get("evidence") or []
    out.append("**Evidence:** " + (", ".join(cite(e) for e in evidence) if evidence else "none cited"))
    out.append(f"**Predicted:** {predicted_text(h.get('predicted'))}"
               + (f"; {h['predicted']['method']}" if (h.get("predicted") or {}).get("method") else ""))
    risks = h.get("risks") or []
    out.append("**Risks:**\n" + ("\n".join(f"- {linked(r)}" for r in risks) if risks
                                 else "- none found in the failures on record"))
    plan = h.get("plan") or {}
    if plan:
        scales = ", ".join(f"{s['params']:.3g}" for s in plan.get("scales", [])
                           if isinstance(s, dict) and isinstance(s.get("params"), (int, float)))
        out.append(f"**Plan:** {plan.get('seeds', '?')} seeds per side at params {scales or '?'}, "
                   f"{plan.get('steps') or '?'} steps, {plan.get('runs', '?')} runs"
                   + ("" if plan.get("fits_budget", True) else " (over budget)")
                   + (f": {plan['why']}" if plan.get("why") else ""))
    d = h.get("decision")
    if d:
        out.append(f"**Decision:** {h['status'] if h['status'] in ('approved', 'rejected') else 'approved'} by "
                   f"{d['by']} at {d['at']}" + (f": {d['reason']}" if d.get("reason") else ""))
    if jobs:
        done = sum(j["status"] in ("succeeded", "failed", "cancelled") for j in jobs)
        out.append(f"**Jobs** ({done} of {len(jobs)} finished): "
                   + ", ".join(f"{cite(j['id'], 'job')} {j['status']}" for j in jobs))
    if h.get("result"):
        out.append(result_markdown(h["result"]))
    return "\n\n".join(out)


def result_markdown(result: dict) -> str:
    """A concluded hypothesis's verdict (runner.conclude's result): the outcome against seed
    noise at each scale, whether it is verified, transfer, and what went wrong."""
    outcome = result.get("outcome", "no verdict")
    lines = [f"**Verdict:** {outcome}" + (" — verified at a second scale" if result.get("verified") else "")
             + f" on {result.get('metric', 'val/loss')}"]
    e = result.get("effect")
    if e:
        low, high = e["interval"]
        lines.append(f"effect {_g(e['delta'])} ({e.get('level', 0.95):.0%} interval {_g(low)} to {_g(high)}, "
                     f"{e.get('method', '')})")
    for s in result.get("scales") or []:
        params = f"{s['params']:.3g}" if isinstance(s.get("params"), (int, float)) else "?"
        runs = ", ".join(cite(r, "run") for r in (s.get("baseline_runs") or []) + (s.get("variant_runs") or []))
        effect = f" {_g(s['delta'])} [{_g(s['interval'][0])}, {_g(s['interval'][1])}]" if "delta" in s else ""
        lines.append(f"- at {params} params: {s.get('outcome')}{effect}" + (f" — runs {runs}" if runs else ""))
    t = result.get("transfer")
    if t:
        at = f" at {t['target']:.3g} {t.get('scale', 'params')}" if isinstance(t.get("target"), (int, float)) else ""
        interval = t.get("interval") or []
        effect = f": {_g(t['delta'])} [{_g(interval[0])}, {_g(interval[1])}]" \
            if isinstance(t.get("delta"), (int, float)) and len(interval) == 2 else ""
        lines.append(f"- scale transfer{at}: {t.get('outcome', '?')}{effect}")
    for err in result.get("errors") or []:
        lines.append(f"- could not judge: {err}")
    return "\n".join(lines)


def reviewer() -> str:
    """Who reviews, by default: the user the server runs as (as `kb approve` takes $USER)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return os.environ.get("USER", "")


# ---- the tab ------------------------------------------------------------------------------------

def build(ui) -> None:
    kb = ui.kb

    def table(status: str):
        return hypothesis_rows(kb.hypotheses(status=None if status == "all" else status))

    def detail(ref: str) -> str:
        ref = (ref or "").strip()
        if not ref:
            return "Select a hypothesis in the table (or open `?hypothesis=ID`)."
        try:
            h = kb.hypothesis(ref)
        except KBError as exc:
            return problem(exc)
        try:
            base = kb.run(h["baseline_run"]).config if h.get("baseline_run") else None
        except NotFound:
            base = None             # the diff shows "?" for the baseline's values
        return hypothesis_markdown(h, base, kb.jobs(hypothesis=ref))

    with gr.Row():
        status = gr.Dropdown(list(STATUSES), value="proposed", label="Status", scale=1)
        refresh = gr.Button("Refresh", scale=0)
    rows = gr.Dataframe(headers=COLUMNS, interactive=False, wrap=True,
                        label="Hypotheses (select one to review it)", elem_id="hypotheses-table")
    chosen = gr.Textbox(label="Hypothesis", placeholder="hyp-…", elem_id="hypothesis-id")
    shown = gr.Markdown(detail(""), elem_id="hypothesis-detail")
    with gr.Row():
        by = gr.Textbox(value=reviewer(), label="Reviewer", scale=1, elem_id="hypothesis-reviewer")
        reason = gr.Textbox(label="Reason", placeholder="why, for whoever reads the history later", scale=3,
                            elem_id="hypothesis-reason")
        backend = gr.Dropdown(list(BACKENDS), value="local", label="Run its jobs on", scale=1)
    with gr.Row():
        approve = gr.Button("Approve and queue its jobs", variant="primary", elem_id="hypothesis-approve")
        reject = gr.Button("Reject", variant="stop", elem_id="hypothesis-reject")
    said = gr.Markdown(elem_id="hypothesis-message")
    with gr.Accordion("Propose new hypotheses", open=False):
        with gr.Row():
            goal = gr.Textbox(label="Goal", placeholder="lower val/loss at fixed compute", scale=3)
            n = gr.Number(value=3, precision=0, minimum=1, maximum=20, label="How many", scale=1)
            project = gr.Textbox(label="Project (optional)", scale=1)
        propose = gr.Button("Propose")

    def selected(data, evt: gr.SelectData):
        row = evt.row_value if evt.row_value is not None else data.values.tolist()[evt.index[0]]
        return row[0]

    def decide(verb: str, ref: str, who: str, why: str, on: str, filt: str):
        ref = (ref or "").strip()
        if not ref:
            return "Select a hypothesis first.", gr.skip(), gr.skip()
        try:
            h = (kb.approve if verb == "approve" else kb.reject)(ref, by=(who or "").strip(), reason=why or "")
        except KBError as exc:
            return problem(exc), gr.skip(), gr.skip()
        d = h["decision"]
        message = f"{cite(ref, 'hypothesis')} {h['status']} by {d['by']}."
        if verb == "approve":
            # approving is the decision to run it: its plan goes to the queue, as `kb submit` does
            try:
                queued = kb.submit(ref, backend=on)
            except KBError as exc:
                message += f" Its jobs were not queued: {problem(exc)}"
            else:
                waiting = [j for j in queued if j["status"] == "queued"]
                held = len(queued) - len(waiting)
                message += (f" {len(waiting)} job(s) queued on {on}"
                            + (f" ({held} more answered by runs the store holds)" if held else "") + ": "
                            + ", ".join(cite(j["id"], "job") for j in queued)
                            + (f". A worker runs them: `kb worker --backend {on}`." if waiting else "."))
        return message, detail(ref), table(filt)

    def proposed(text: str, count, proj: str):
        try:
            found = ui.locked(kb.propose, goal=text or "", n=int(count or 3), project=(proj or "").strip() or None)
        except KBError as exc:
            return problem(exc), gr.skip(), gr.skip()
        return (f"{len(found)} hypothesis(es) proposed: " + ", ".join(cite(h["id"], "hypothesis") for h in found),
                "proposed", table("proposed"))

    # a decision's table (of the status read at its click) cannot land after a later status
    # change's. Propose stays apart: it takes seconds, and it sets the status with its table
    in_order = in_arrival_order("hypotheses-table")
    gr.on(None, lambda: table("proposed"), None, rows, **in_order)      # on page load
    status.change(table, status, rows, **in_order)
    refresh.click(table, status, rows, **in_order)
    rows.select(selected, rows, chosen)
    chosen.change(detail, chosen, shown)
    approve.click(lambda *a: decide("approve", *a), [chosen, by, reason, backend, status], [said, shown, rows],
                  **in_order)
    reject.click(lambda *a: decide("reject", *a), [chosen, by, reason, backend, status], [said, shown, rows],
                 **in_order)
    propose.click(proposed, [goal, n, project], [said, status, rows])

    ui.link("hypothesis", ID, lambda ref: {chosen: ref, shown: detail(ref)}, [chosen, shown])
