"""The chat's messages as Markdown: an answer with its citations as links to the records they
name, the SQL behind its numbers folded away, an abstention shown as one, and proposals.

    answer_markdown(kb.ask("best lr at 125M?").as_dict())
    proposals_markdown(kb.propose(goal="lower val/loss", n=3), goal="lower val/loss")

Inputs are the contract's JSON shapes (SPEC: Answer, Hypothesis), so these work on what the
REST API returns as well as on the Python objects' `as_dict()`.
"""
from __future__ import annotations

import re
from typing import Mapping, Sequence

from kb.ui.context import LINK_KINDS, href
from kb.ui.records import code_block, esc, fmt

NO_EVIDENCE_MARK = "No evidence"
QUOTE_CHARS = 160


def is_abstention(answer: Mapping) -> bool:
    """The agent found nothing to stand on: no citation and no SQL behind the text."""
    return not answer.get("citations") and not answer.get("sql")


def answer_markdown(answer: Mapping) -> str:
    """The answer's text with each [n] a link to the record it cites, the sources listed under it
    with the words of each that support the answer, and the SQL folded in a <details> block."""
    if is_abstention(answer):
        return (f"> **∅ {NO_EVIDENCE_MARK}.** {esc(answer.get('answer') or '')}\n>\n"
                "> _Nothing in the knowledge base supports an answer. Try naming a project, a run or a "
                "metric, or ask what the runs measured._")
    citations = answer.get("citations") or []

    def marker(m: re.Match) -> str:
        n = int(m.group(1))
        if 1 <= n <= len(citations):
            c = citations[n - 1]
            return f"[\\[{n}\\]]({_href(c)} \"{c['kind']} {_title(c['id'])}\")"
        return m.group(0)

    # the answer's own words are escaped first, so only the markers become links
    text = re.sub(r"\\\[(\d+)\\\]", marker, esc(answer.get("answer") or ""))
    parts = [text]
    if citations:
        parts += ["", "**Sources**", ""]
        for n, c in enumerate(citations, 1):
            quote = " ".join(str(c.get("quote") or "").split())
            quote = quote if len(quote) <= QUOTE_CHARS else quote[:QUOTE_CHARS - 1] + "…"
            said = f" — “{esc(quote)}”" if quote else ""
            parts.append(f"{n}. {c['kind']} [{esc(c['id'])}]({_href(c)}){said}")
    if answer.get("sql"):
        parts += ["", "<details><summary>SQL the agent ran</summary>", "", code_block(answer["sql"], "sql"),
                  "", "</details>"]
    return "\n".join(parts)


def proposals_markdown(hypotheses: Sequence[Mapping], goal: str = "") -> str:
    """Each proposed hypothesis as a link to it (the Hypotheses tab opens it), with its change,
    predicted effect and baseline run."""
    aim = f" for “{esc(goal)}”" if goal else ""
    if not hypotheses:
        return (f"> **∅ No proposals{aim}.** The runs give nothing to build a hypothesis on yet "
                "(a proposal needs a baseline run with a measured metric).")
    lines = [f"**Proposed experiments**{aim} — stored as `proposed`; approve them in the Hypotheses tab:", ""]
    for n, h in enumerate(hypotheses, 1):
        lines.append(f"{n}. [{esc(h.get('title') or h['id'])}]({href('hypothesis', h['id'])}) `{h['id']}`")
        change = h.get("change") or {}
        if change:
            lines.append("   - change " + ", ".join(f"`{esc(k)}` → {esc(fmt(v))}" for k, v in change.items()))
        predicted = h.get("predicted") or {}
        if predicted.get("metric"):
            interval = predicted.get("interval")
            band = (f" (interval {fmt(interval[0])} to {fmt(interval[1])})"
                    if isinstance(interval, (list, tuple)) and len(interval) == 2 else "")
            delta = predicted.get("delta")
            lines.append(f"   - predicted {esc(predicted['metric'])} Δ "
                         f"{'—' if delta is None else f'{delta:+.4g}'}{band}")
        if h.get("baseline_run"):
            lines.append(f"   - baseline [{esc(h['baseline_run'])}]({href('run', h['baseline_run'])})")
        if h.get("rationale"):
            lines.append(f"   - _{esc(h['rationale'])[:400]}_")
    return "\n".join(lines)


def error_markdown(message: str) -> str:
    return f"> **Could not answer.** {esc(message.splitlines()[0] if message else 'unknown error')}"


def _href(citation: Mapping) -> str:
    kind = citation["kind"] if citation["kind"] in LINK_KINDS else "run"
    return href(kind, citation["id"])


def _title(ref: str) -> str:
    return str(ref).replace('"', "'")
