"""Explanations from the records themselves: "why did run B do worse than run A" diffs the two
runs; "why did X diverge / fail" reads X's failures with their evidence lines, its anomalies, and
the ablation that shows which values of the varied factor completed. Every sentence cites the
run, failure or ablation it reads, and every number comes from those records.
"""
from __future__ import annotations

import re

from agents.evidence import NO_EVIDENCE, Answer, Citation
from kb.fields import leaves
from kb.vocab import canonical_metrics

_WORSE = re.compile(r"\bwhy\b.*?\b(?:did|does|was|is)\b\s+(?P<b>.+?)\s+(?:do|perform|score|end|come out|turn out)?\s*"
                    r"(?:up\s+)?(?P<dir>worse|better|higher|lower)\s+than\s+(?P<a>.+?)[?.!]*$", re.I)
_FAILING = r"(?:diverge|blow up|fail|crash|die|go nan|oom|stop|hang)\w*\b"
_FAILED = re.compile(r"\bwhy\b.*?\b(?:did|does|was|has)\b\s+(?P<x>.+?)\s+" + _FAILING, re.I)
# "at what step did X fail": the same record read, the step its answer
_FAILED_AT = re.compile(r"\b(?:at\s+)?(?:what|which)\s+step\s+(?:did|does|was|has)\s+(?P<x>.+?)\s+" + _FAILING,
                        re.I)
_NAMES_A_RUN = re.compile(r"\w*\d\w*[-_.:/]\w|\w[-_.:/]\w*\d")
_KNOW = re.compile(r"\b(what do we know|what have we learn(?:ed|t)|what did we learn|summari[sz]e|"
                   r"lessons?|findings?)\b", re.I)
_MAX_ABLATIONS = 3
_MAX_DIFFS = 6
_METRIC_ORDER = ("val/loss", "train/loss")


def explain(kb, question: str, retriever) -> Answer | None:
    if _KNOW.search(question):
        return what_we_know(kb, question, retriever)
    m = _WORSE.search(question)
    if m:
        b, a = _one_run(retriever, m.group("b")), _one_run(retriever, m.group("a"))
        if a and b and a != b:
            return _compare(kb, kb.run(a), kb.run(b))
        return None
    m = _FAILED.search(question) or _FAILED_AT.search(question)
    if m:
        x = _one_run(retriever, m.group("x"))
        if x is None and _NAMES_A_RUN.search(m.group("x")):
            return Answer(NO_EVIDENCE)      # a run id no run has: not some other run's failure
        if x is None:
            hits = retriever.retrieve(question, k=5, kinds={"failure", "run"},
                                      where="status in ('diverged', 'failed', 'crashed')")
            x = next((h.chunk.run_id for h in hits if h.chunk.run_id), None)
        if x:
            return _failure(kb, kb.run(x), retriever)
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
        out.append("Their configurations are identical, so the difference is noise or data order [1][2].")
    _failure_sentences(b, cites, out)
    seen = {(x["kind"], x["key"]) for x in a.anomalies}
    for an in [x for x in b.anomalies if (x["kind"], x["key"]) not in seen][:3]:
        out.append(f"Run {b.id} had a {an['kind']} in {an['key']} at step {an['step']} that run {a.id} did not [2].")
    return Answer(" ".join(out), cites)


def _failure(kb, x, retriever=None) -> Answer:
    cites = [Citation("run", x.id, x.name or x.id)]
    out = [f"Run {x.id} ended with status {x.status} [1]."]
    _failure_sentences(x, cites, out)
    if retriever is not None:
        _postmortems(x, retriever, cites, out)
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


def _postmortems(run, retriever, cites: list[Citation], out: list[str], limit: int = 2) -> None:
    """Notes that name the run (a postmortem, an incident write-up): their line about it."""
    hits = retriever.retrieve(f"{run.id} {run.name or ''} failure cause", k=6, kinds={"note"})
    names = (run.id, run.name or run.id)
    for h in hits:
        text = h.chunk.text
        if not any(n in text for n in names):
            continue
        line, verb = line_about(text, names)
        if line is None:
            continue
        cites.append(Citation("note", h.chunk.id, line[:200]))
        out.append(f"A note on it {verb}: {line[:240].rstrip('.')} [{len(cites)}].")
        if sum(c.kind == "note" for c in cites) >= limit:
            return


_TABLE_RULE = re.compile(r"^\|?\s*:?-{3,}")        # the |---|---| line under a Markdown table's header


def line_about(text: str, names: tuple[str, ...]) -> tuple[str | None, str]:
    """A note chunk's line about a run (one naming it, else its first line of prose; its first
    line is its title) and the verb to quote it with: a Markdown table row is given as
    `column: cell` pairs from its table's header, so a quote is never a bare header or row of
    cells. (None, "") when the chunk has neither."""
    lines = [ln.strip() for ln in text.splitlines()[1:] if ln.strip()] or [text.strip()]
    for i, line in enumerate(lines):
        if any(n and n in line for n in names):
            return (_table_row(lines, i), "lists") if line.startswith("|") else (line, "says")
    prose = next((ln for ln in lines if not ln.startswith(("|", "#", "```", "~~~"))), None)
    return (prose, "says") if prose else (None, "")


def _table_row(lines: list[str], i: int) -> str:
    start = i
    while start > 0 and lines[start - 1].startswith("|"):
        start -= 1
    cells = _cells(lines[i])
    if i - start >= 2 and _TABLE_RULE.match(lines[start + 1]):
        header = _cells(lines[start])
        if len(header) == len(cells):
            return "; ".join(f"{h}: {c}" for h, c in zip(header, cells) if c)
    return ", ".join(c for c in cells if c)


def _cells(line: str) -> list[str]:
    return [c.strip().strip("`").strip() for c in line.strip().strip("|").split("|")]


def _failure_sentences(run, cites: list[Citation], out: list[str]) -> None:
    for f in run.failures[:2]:
        if f.get("id") is not None:
            _failure_sentence(run.id, f, cites, out)


def _failure_sentence(run_id: str, f: dict, cites: list[Citation], out: list[str]) -> None:
    cites.append(Citation("failure", str(f["id"]), (f.get("evidence") or f.get("message") or "")[:200]))
    at = f" at step {f['step']}" if f.get("step") is not None else ""
    line = (f.get("evidence") or f.get("message") or "").strip().splitlines()
    said = f": {line[0][:160]}" if line else ""
    out.append(f"Run {run_id} failed with {f['kind']}{at}{said} [{len(cites)}].")


def _diff(a: dict, b: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    la = {".".join(p): v for p, v in leaves(a) if p and not isinstance(v, (dict, list))}
    lb = {".".join(p): v for p, v in leaves(b) if p and not isinstance(v, (dict, list))}
    keys = sorted(set(la) | set(lb))
    return [(prefix + k, la.get(k, "unset"), lb.get(k, "unset")) for k in keys if la.get(k) != lb.get(k)]


def what_we_know(kb, question: str, retriever=None) -> Answer | None:
    """ "What do we know about batch size 256 vs 512?": the ablations whose factor the question
    names, the failures of a kind it names ("the NCCL timeouts") with their evidence lines, and
    the lines of notes about its topic, each cited. None when no record is about it."""
    cites: list[Citation] = []
    out: list[str] = []
    kinds = {kind: words for kind, words in _FAILURE_WORDS if words.search(question)}
    _ablation_findings(kb, question, cites, out)
    _failure_findings(kb, kinds, cites, out)
    if retriever is not None:
        _note_findings(retriever, question, kinds, cites, out)
    return Answer(" ".join(out), cites) if out else None


def _ablation_findings(kb, question: str, cites: list[Citation], out: list[str]) -> None:
    """The ablations whose factor the question names (by the vocabulary's name for it, or by the
    values it compared), each with its values, their final metric and whether the effect clears
    the seed noise."""
    from sqlmodel import Session, select

    from agents.planner import fmt
    from agents.sparse import tokens
    from kb.models import Ablation
    from kb.vocab import fold, hparam_name

    asked = set(tokens(question))
    asked_folded = {fold(t) for t in asked}
    words = question.lower().split()
    named = {hparam_name(" ".join(words[i:i + n])) for n in (1, 2, 3) for i in range(len(words))} - {None}
    scored = []
    with Session(kb.engine) as s:
        for abl in s.exec(select(Ablation).limit(5000)):
            leaf = abl.factor.rsplit(".", 1)[-1]
            by_name = hparam_name(leaf) in named or fold(leaf) in asked_folded
            values = {str(v.get("value")).lower() for v in abl.variants}
            value_tokens = values.union(*(tokens(v) for v in values))
            by_value = asked & value_tokens
            if by_name or len(by_value) >= 1 and any(not t[0].isdigit() for t in by_value) or len(by_value) >= 2:
                scored.append((by_name + len(by_value), abl))
    scored.sort(key=lambda x: (-x[0], x[1].project, x[1].id))
    for _, abl in scored[:_MAX_ABLATIONS]:
        ok = [v for v in abl.variants if v.get("metric") is not None]
        if not ok:
            continue
        cites.append(Citation("ablation", abl.id, f"{abl.factor} varied, {abl.metric} compared"))
        listed = "; ".join(f"{_value(v['value'])}: {fmt(v['metric'], True)}"
                           + (f" over {v['seeds']} seeds" if (v.get("seeds") or 1) > 1 else "") for v in ok)
        best = min(ok, key=lambda v: v["metric"])
        noise = ""
        if abl.effect.get("seed_sigma") is not None:
            clears = any(v.get("exceeds_seed_spread") for v in ok if not v.get("baseline"))
            noise = (f"; the difference {'exceeds' if clears else 'is within'} the seed noise "
                     f"(sigma {abl.effect['seed_sigma']:.4g})")
        out.append(f"In project {abl.project}, the ablation of {abl.factor} gave final {abl.metric} {listed}; "
                   f"the lowest was {_value(best['value'])}{noise} [{len(cites)}].")


# failure kinds (kb.records.FailureKind) by the words people use for them
_FAILURE_WORDS = (("oom", re.compile(r"\bo\.?o\.?ms?\b|out[- ]of[- ]memory", re.I)),
                  ("nccl_timeout", re.compile(r"\bnccl\b|collective timeouts?|watchdog", re.I)),
                  ("hardware", re.compile(r"\bhardware\b|\becc\b|\bxid\b|gpu (?:fault|error|failure)s?", re.I)),
                  ("diverged", re.compile(r"\bdiverg\w*|\bnans?\b|blow[- ]?ups?", re.I)),
                  ("killed", re.compile(r"\bpreempt\w*|\bkilled\b", re.I)))
_MAX_FAILURES = 4


def _failure_findings(kb, kinds: dict, cites: list[Citation], out: list[str]) -> None:
    """Failures of the kinds the question names (by kind, then run), each with its evidence line."""
    from sqlmodel import Session, select

    from kb.models import Failure

    if not kinds:
        return
    with Session(kb.engine) as s:
        found = s.exec(select(Failure).where(Failure.kind.in_(sorted(kinds)))
                       .order_by(Failure.kind, Failure.run_id, Failure.id).limit(_MAX_FAILURES)).all()
    for f in found:
        _failure_sentence(f.run_id, {"id": f.id, "kind": f.kind, "step": f.step, "message": f.message,
                                     "evidence": f.evidence}, cites, out)


def _note_findings(retriever, question: str, kinds: dict, cites: list[Citation], out: list[str],
                   limit: int = 2) -> None:
    """The sentence of each of the top notes that holds the question's topic: its words (not its
    generic ones: a note that shares only "loss" with the question is not about it), or the words
    for a failure kind it names ("the divergences" is about the line where a run "went NaN")."""
    from agents.sparse import GENERIC, tokens
    from agents.verify import sentences

    wanted = set(tokens(question)) - GENERIC
    if not wanted and not kinds:
        return

    def topic(line: str) -> int:
        return len(wanted & set(tokens(line))) + sum(bool(words.search(line)) for words in kinds.values())

    for h in retriever.retrieve(question, k=6, kinds={"note"}):
        # the first line is the title, and a heading is no finding; one sentence is quoted, as
        # the verifier reads the answer sentence by sentence and keeps only those that cite
        lines = [ln.strip() for ln in h.chunk.text.splitlines()[1:] if ln.strip() and not ln.lstrip().startswith("#")]
        best = max((sent for ln in lines or [h.chunk.text.strip()] for sent in sentences(ln)), key=topic, default="")
        if not topic(best):
            continue
        cites.append(Citation("note", h.chunk.id, best[:200]))
        out.append(f"A note says: {best[:240].rstrip('.')} [{len(cites)}].")
        if sum(c.kind == "note" for c in cites) >= limit:
            return


def _value(value) -> str:
    """A variant's value as written: a tag ablation's variants are config differences."""
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "the baseline config"
    return str(value)
