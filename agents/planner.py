"""The deterministic planner: quantitative questions answered from SQL, never from an LLM's reading.

The 135M default LLM misreads numbers when asked to read them, so the questions whose answer is
a number or a ranking (lowest/highest X, how many runs, mean or median of X by a group, what
changed between two runs, the best config at a scale, which learning rates diverged) are parsed
without an LLM (agents.planner_parse), run as one read-only SELECT (agents.planner_sql,
agents.sql), and written from templates with the numbers exactly as the SQL returned them:

    a = plan_and_answer("Which learning rate gave the lowest val loss for the 125M runs?", kb)
    a.text       # "Run base-lr0.0003 has the lowest val/loss of the 4 runs at ~125M params: ..."
    a.citations  # [Citation("run", "base-lr0.0003", "summary.val/loss=3.21, hparams.lr=0.0003"), ...]
    a.sql, a.rows, a.plan      # the SQL as it ran (runnable as printed), its rows, the parsed plan

Anything else returns None, and the caller retrieves and lets the LLM answer. `context` is the
previous turn's plan (or {"plan": plan}), so "and at 350M?" reuses the last question's shape.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy import literal, select, union_all

from agents.evidence import NO_EVIDENCE, Answer, Citation
from agents.planner_parse import Plan, follow_up, parse
from agents.planner_sql import GROUP_MEMBERS, field, run, statement
from kb.query_sql import codepoint
from agents.planner_words import HIGHER_IS_BETTER, label
from agents.sql import ReadOnlySQL, SQLResult, SQLTimeout

log = logging.getLogger(__name__)
MAX_QUESTION = 500       # characters; longer is prose for the retriever, not a quantitative question
MAX_LISTED = 20          # values or keys written out in one answer; the rows keep them all
# a word that may be a run's name: it has a digit or a joiner (ids and names people paste)
NAME_LIKE = re.compile(r"[\d_.:/-]")
# a question that continues the previous one, even if it would also stand alone
CONTINUES = re.compile(r"\s*(and|what about|how about|same for|also|now)\b", re.I)


@dataclass
class PlannedAnswer(Answer):
    plan: Plan | None = None        # what the question was parsed into, for a follow-up


def plan_and_answer(question: str, kb, *, context: Any = None, sql: ReadOnlySQL | None = None) -> PlannedAnswer | None:
    """The planner's answer to `question` over the store of `kb` (a KnowledgeBase), or None
    when the question is not one of its shapes. `sql`: a read-only connection to reuse."""
    question = re.sub(r"[\x00-\x1f\x7f]+", " ", question or "").strip()
    if not question or len(question) > MAX_QUESTION:
        return None
    ro = sql or ReadOnlySQL(kb.settings.sql_url)
    try:
        known: dict[str, tuple[str, str] | None] = {}      # one lookup per word, for both parses

        def linker(words: list[str]) -> dict[str, tuple[str, str]]:
            todo = [w for w in dict.fromkeys(words) if w not in known]
            if todo:
                try:
                    found = link_words(ro, todo)
                except SQLTimeout:
                    # words left unlinked parse as plain words: a question still gets its
                    # answer (less pinned down), not an error, when a huge store is slow here
                    log.warning("linking the question's words to runs timed out; answering without links")
                    found = {}
                known.update({w: found.get(w) for w in todo})
            return {w: known[w] for w in words if known.get(w)}

        previous = _previous(context)
        plan = None
        if previous is not None and CONTINUES.match(question):     # "and the highest val loss?"
            plan = follow_up(question, previous, linker)
        plan = plan or parse(question, linker)
        if plan is None and previous is not None:                   # "at 350M?"
            plan = follow_up(question, previous, linker)
        return None if plan is None else answer(plan, ro)
    finally:
        if sql is None:
            ro.close()


def link_words(ro: ReadOnlySQL, words: list[str]) -> dict[str, tuple[str, str]]:
    """{word: ("run", id) | ("project", name)} for the words that name a run (by id, or by a
    name only one run has) or a project."""
    words = [w for w in words if 0 < len(w) <= 200][:50]
    if not words:
        return {}
    names = [w for w in words if NAME_LIKE.search(w)]     # run.name has no index: look up few
    parts = [select(literal("id").label("kind"), run.c.id.label("ref"), run.c.id.label("word"))
             .where(run.c.id.in_(words)),
             select(literal("project"), run.c.project, run.c.project).where(run.c.project.in_(words)).distinct()]
    if names:
        parts.append(select(literal("name"), run.c.id, run.c.name).where(run.c.name.in_(names)))
    # a config value ("rmsnorm", "rope"): one categorical key holds it; a word that is a value
    # of several keys names none of them
    spellings = {w: w for w in words} | {w.lower(): w for w in words if w.lower() not in words}
    values = (select(literal("value"), field.c.key, field.c.text)
              .where(field.c.vtype == "s", field.c.text.in_(list(spellings)),
                     codepoint(field.c.key) >= "config.", codepoint(field.c.key) < "config/")
              .distinct().limit(200))
    found: dict[str, tuple[str, str]] = {}
    named: dict[str, set[str]] = {}
    valued: dict[str, set[tuple[str, str]]] = {}
    for _, key, text in ro.run(values).rows:       # apart: SQLite allows no LIMIT inside a UNION
        valued.setdefault(spellings[text], set()).add((key, text))
    for kind, ref, word in ro.run(union_all(*parts)).rows:
        if kind == "id":
            found[word] = ("run", ref)
        elif kind == "name":
            named.setdefault(word, set()).add(ref)
        else:
            found.setdefault(word, ("project", ref))
    for word, refs in named.items():
        if word not in found and len(refs) == 1:          # a name several runs share names none
            found[word] = ("run", refs.pop())
    for word, keys in valued.items():
        if word not in found and len({k for k, _ in keys}) == 1:
            key, text = keys.pop()
            found[word] = ("value", key, text)
    return found


def _previous(context: Any) -> Plan | None:
    if isinstance(context, dict):
        context = context.get("plan")
    if isinstance(context, dict):
        return Plan.from_dict(context)
    return context if isinstance(context, Plan) else None


# ---- answers ---------------------------------------------------------------------------------

def answer(plan: Plan, ro: ReadOnlySQL) -> PlannedAnswer:
    result = ro.run(statement(plan))
    rows = result.dicts()
    if not rows and plan.shape != "diff":
        return _no_evidence(plan, result)
    text, citations = WRITERS[plan.shape](plan, rows)
    return PlannedAnswer(text, citations, result.sql, rows, plan=plan)


def fmt(value: Any, computed: bool = False) -> str:
    """A value as the SQL returned it, in digits that read back to the same number (Python's
    shortest round-trip repr). `computed` (a mean, a median): 12 significant digits, since
    past them is the float noise of the sum (3.6434100000000003 is 3.64341)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}" if computed else repr(value)
    return "null" if value is None else str(value)


def scope(plan: Plan) -> str:
    return " ".join(c.words for c in plan.where) or "in the store"


def _run(row: dict) -> str:
    rid, name = row["run_id"], row.get("name")
    return f"run {rid}" + (f" ({name})" if name and name != rid else "")


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _quote(row: dict, keys) -> str:
    return ", ".join(f"{k}={fmt(row[k])}" for k in keys if row.get(k) is not None)


def _no_evidence(plan: Plan, result: SQLResult) -> PlannedAnswer:
    key = plan.report[0] if plan.shape == "values" else plan.metric
    what = f" with a numeric {label(key)}" if key else ""
    text = f"{NO_EVIDENCE} I searched for runs {scope(plan)}{what}, and none matched."
    return PlannedAnswer(text, [], result.sql, [], plan=plan)


def _extreme(plan: Plan, rows: list[dict]) -> tuple[str, list[Citation]]:
    keys = [plan.metric, *plan.report]
    end = "lowest" if plan.lowest else "highest"
    best, n = rows[0], rows[0]["candidates"]
    extra = "".join(f", with {label(k)} {fmt(best[k])}" if best.get(k) is not None else f", with no {label(k)} recorded"
                    for k in plan.report)
    first = (f"{_cap(_run(best))} is the only run {scope(plan)} with a {label(plan.metric)}" if n == 1 else
             f"{_cap(_run(best))} has the {end} {label(plan.metric)} of the {n} runs {scope(plan)}")
    text = [f"{first}: {label(plan.metric)} {fmt(best[plan.metric])}{extra}."]
    if len(rows) > 1:
        text.append("Next: " + "; ".join(
            f"{_run(r)} with {label(plan.metric)} {fmt(r[plan.metric])}"
            + "".join(f", {label(k)} {fmt(r[k])}" for k in plan.report if r.get(k) is not None)
            for r in rows[1:]) + ".")
    return " ".join(text), [Citation("run", r["run_id"], _quote(r, keys)) for r in rows]


def _count(plan: Plan, rows: list[dict]) -> tuple[str, list[Citation]]:
    n = rows[0]["runs"]
    first = f"There {'are' if n != 1 else 'is'} {n} run{'s' if n != 1 else ''} {scope(plan)}."
    listed = ", ".join(_run(r) for r in rows)
    second = f"{'They are' if len(rows) == n else 'They include'} {listed}." if n > 1 else f"It is {listed}."
    return f"{first} {second}", [Citation("run", r["run_id"], f"status={r['status']}") for r in rows]


def _values(plan: Plan, rows: list[dict]) -> tuple[str, list[Citation]]:
    key = plan.report[0]
    if all(c.dim == "runs" for c in plan.where):        # a lookup: "what lr did run X use?"
        text = " ".join(f"{_cap(_run(r))} has {label(key)} {fmt(r[key])}." for r in rows)
        return text, [Citation("run", r["run_id"], _quote(r, [key])) for r in rows]
    groups: dict[Any, list[dict]] = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r)
    shown = list(groups.items())[:MAX_LISTED]
    text = [f"The {label(key)} values of the runs {scope(plan)}: {', '.join(fmt(v) for v, _ in shown)}"
            + ("; more in the rows." if len(groups) > MAX_LISTED else ".")]
    cited = []
    for value, members in shown:
        runs = members[:GROUP_MEMBERS]
        cited += runs
        text.append(f"With {label(key)} {fmt(value)}: " + ", ".join(
            _run(r) + (f", failed at step {fmt(r['failure_step'])}" if r.get("failure_step") is not None else "")
            for r in runs) + ("; and more." if len(members) > len(runs) else "."))
    return " ".join(text), [Citation("run", r["run_id"], _quote(r, [key, "status", "failure_step"])) for r in cited]


def _aggregate(plan: Plan, rows: list[dict]) -> tuple[str, list[Citation]]:
    stat = plan.aggregate
    metric = label(plan.metric)
    groups: dict[Any, list[dict]] = {}
    for r in rows:
        by = None if not plan.group else "run_id" if plan.group == "run" else "group" if "group" in r else plan.group
        groups.setdefault(r[by] if by else None, []).append(r)
    text, cited = [], []
    for g, members in list(groups.items())[:MAX_LISTED]:
        head, n = members[0], members[0]["runs"]
        cited += members
        runs = ", ".join(_run(r) for r in members)
        if plan.group == "run":
            text.append(f"{_cap(_run(head))}: {metric} {fmt(head[plan.metric])}.")
        elif plan.group:
            text.append(f"At {label(plan.group)} {fmt(g)}, the {stat} {metric} is {fmt(head[stat], True)} over {n} "
                        f"run{'s' if n != 1 else ''} ({runs}{', ...' if n > len(members) else ''}).")
        else:
            text.append(f"The {stat} {metric} of the {n} runs {scope(plan)} is {fmt(head[stat], True)}"
                        f" ({runs}{', ...' if n > len(members) else ''}).")
    if plan.group and len(groups) > 1:
        pick = min if plan.metric not in HIGHER_IS_BETTER else max
        col = plan.metric if plan.group == "run" else stat
        g, members = pick(groups.items(), key=lambda kv: kv[1][0][col])
        where = _run(members[0]) if plan.group == "run" else f"{label(plan.group)} {fmt(g)}"
        text.append(f"The best {'' if plan.group == 'run' else stat + ' '}{metric} is at {where}: {fmt(members[0][col], plan.group != 'run')}.")
    keys = [plan.metric] + ([plan.group] if plan.group and plan.group != "run" else [])
    return " ".join(text), [Citation("run", r["run_id"], _quote(r, keys)) for r in cited]


def _leaf(vtype: str | None, num: Any, text: Any) -> str:
    if vtype is None:
        return "absent"
    if vtype == "b":
        return "true" if num else "false"
    return {"n": fmt(num), "s": f"'{text}'", "z": "null"}.get(vtype, fmt(text if num is None else num))


def _diff(plan: Plan, rows: list[dict]) -> tuple[str, list[Citation]]:
    a, b = plan.runs
    if not rows:
        text = f"Run {a} and run {b} have the same config, scale and tags."
        return text, [Citation("run", a, "same config as " + b), Citation("run", b, "same config as " + a)]
    sides = [(r["key"], _leaf(r["a_vtype"], r["a_num"], r["a_text"]), _leaf(r["b_vtype"], r["b_num"], r["b_text"]))
             for r in rows]
    text = [f"Run {a} and run {b} differ in these config, scale and tag keys."]
    text += [f"In {k}, run {a} has {va} and run {b} has {vb}." for k, va, vb in sides[:MAX_LISTED]]
    if len(sides) > MAX_LISTED:
        text.append("More keys differ; the rows list them all.")
    quote_a = ", ".join(f"{k}={va}" for k, va, _ in sides[:MAX_LISTED])
    quote_b = ", ".join(f"{k}={vb}" for k, _, vb in sides[:MAX_LISTED])
    return " ".join(text), [Citation("run", a, quote_a), Citation("run", b, quote_b)]


def _best_config(plan: Plan, rows: list[dict]) -> tuple[str, list[Citation]]:
    best, n = rows[0], rows[0]["candidates"]
    end = "lowest" if plan.lowest else "highest"
    field = f"is the only run {scope(plan)} with a {label(plan.metric)}" if n == 1 else \
        f"has the {end} {label(plan.metric)} of the {n} runs {scope(plan)}"
    leaves = [(r["key"], _leaf(r["vtype"], r["num"], r["text"])) for r in rows if r["key"] is not None]
    text = [f"{_cap(_run(best))} {field}: {label(plan.metric)} {fmt(best[plan.metric])}."]
    if leaves:
        shown = ", ".join(f"{label(k)}={v}" for k, v in leaves[:MAX_LISTED * 2])
        text.append(f"The config of run {best['run_id']}: {shown}{', ...' if len(leaves) > MAX_LISTED * 2 else ''}.")
    else:
        text.append(f"Run {best['run_id']} logged no config.")
    quote = _quote(best, [plan.metric]) + "".join(f", {k}={v}" for k, v in leaves[:MAX_LISTED])
    return " ".join(text), [Citation("run", best["run_id"], quote)]


WRITERS = {"extreme": _extreme, "count": _count, "runs": _count, "values": _values, "aggregate": _aggregate,
           "diff": _diff, "best_config": _best_config}
