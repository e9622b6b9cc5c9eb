"""How an answer is scored against a question of benchmarks/qa_questions.py: retrieval recall@5
and reciprocal rank, citation validity, numeric faithfulness, exact answers, abstention.

Numbers are read and compared by the agent's own verifier (agents.verify: `3e-4` = `0.0003`,
`125M` = `1.25e8`, a value written with fewer digits matches one that rounds to it), so the
harness and the verification pass apply one rule. What counts as evidence is decided here,
independently: only the records the answer cites (their text and their full stored values),
the SQL rows it returned, and the question itself.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlmodel import Session

from agents.corpus import chunks_by_key, record_values
from agents.verify import Written, matches, numbers_in, values_of
from kb.models import Ablation, Failure, Note, Run

ABSTAIN = re.compile(r"no evidence|not find|n't find|no (?:record|information|data|runs?) (?:about|on|for|of)|"
                     r"(?:don't|do not|cannot|can't) (?:know|find|answer)|not (?:in|mentioned in|covered by) the "
                     r"(?:sources|context|knowledge base|records)|empty response|no relevant", re.I)
_MARK = re.compile(r"\s*\[\d+(?:\s*,\s*\d+)*\]")
EXACT_REL = 0.005      # an exact answer may round, but not by more than half a percent


@dataclass
class Scored:
    """One question's outcome for one system."""
    qid: str
    shape: str
    answerable: bool
    recall5: float | None = None          # None: the question has no gold records to retrieve
    rr: float | None = None
    hybrid_recall5: float | None = None   # the agent's hybrid retriever alone, for comparison
    citations: int = 0
    valid_citations: int = 0
    numbers: int = 0
    supported_numbers: int = 0
    faithful: bool = True                 # every number in the answer was supported
    exact: bool | None = None             # None: the question has no single right answer
    abstained: bool = False
    cites_gold: bool | None = None
    retrieve_ms: float | None = None
    answer_ms: float | None = None
    problems: list[str] = field(default_factory=list)
    text: str = ""
    raw: dict = field(default_factory=dict)     # ranked keys, citations, SQL and rows: to score again


# ---- gold records ------------------------------------------------------------------------------

def _norm(text: str) -> str:
    return " ".join(text.split()).lower()


def resolve(engine, gold: list[str]) -> set[str]:
    """Symbolic gold references -> the `kind:id` keys the store gave those records."""
    out: set[str] = set()
    with Session(engine) as s:
        for ref in gold:
            if ref.startswith("run:"):
                if s.get(Run, ref[4:]) is not None:
                    out.add(ref)
            elif ref.startswith("run@"):
                project, _, name = ref[4:].partition("/")
                out |= {f"run:{i}" for i in s.execute(select(Run.id).where(Run.project == project,
                                                                            Run.name == name)).scalars()}
            elif ref.startswith("failure:"):
                out |= {f"failure:{i}" for i in s.execute(select(Failure.id).where(
                    Failure.run_id == ref[8:])).scalars()}
            elif ref.startswith("note~"):
                phrase = _norm(ref[5:])
                out |= {f"note:{n.id}" for n in s.execute(select(Note)).scalars()
                        if phrase in _norm(f"{n.title}\n{n.text}")}
            elif ref.startswith("ablation:"):
                project, _, factor = ref[9:].partition("/")
                leaf = factor.rsplit(".", 1)[-1]
                out |= {f"ablation:{a.id}" for a in s.execute(select(Ablation).where(Ablation.project == project))
                        .scalars() if a.factor == factor or a.factor.rsplit(".", 1)[-1] == leaf}
    return out


def run_labels(engine, keys: set[str]) -> list[str]:
    """Ids and names of the runs among `keys`: what an answer may call a run by."""
    ids = [k[4:] for k in keys if k.startswith("run:")]
    if not ids:
        return []
    with Session(engine) as s:
        return [x for row in s.execute(select(Run.id, Run.name).where(Run.id.in_(ids))) for x in row if x]


# ---- the measures --------------------------------------------------------------------------------

def retrieval(ranked: list[str], gold: set[str]) -> tuple[float, float]:
    """recall@5 (of the gold records, or of 5 when there are more) and reciprocal rank."""
    hit = len(set(ranked[:5]) & gold) / min(5, len(gold))
    rank = next((i for i, k in enumerate(ranked, 1) if k in gold), None)
    return hit, (1.0 / rank if rank else 0.0)


def abstained(text: str) -> bool:
    return not text.strip() or bool(ABSTAIN.search(text))


def plain(text: str) -> str:
    """The answer without its [n] citation markers (they are not numbers it claims)."""
    return _MARK.sub("", text)


def evidence_values(engine, keys: list[str], rows, sql: str | None, question: str,
                    texts: dict[str, str] | None = None) -> list[float]:
    """Every number the cited records (text and stored values), the SQL rows and the question hold."""
    texts = dict(texts or {})
    missing = [k for k in keys if k not in texts]
    texts.update({k: c.text for k, c in chunks_by_key(engine, missing).items()})
    out = values_of(question) + values_of(rows or []) + values_of(sql or "")
    for k in keys:
        out += values_of(texts.get(k, "")) + values_of(k.partition(":")[2])
    for v in record_values(engine, keys).values():
        out += values_of(v)
    return out


def faithfulness(text: str, evidence: list[float]) -> tuple[int, int]:
    """(numbers written, numbers supported by the evidence)."""
    written = numbers_in(plain(text))
    return len(written), sum(any(matches(w, v) for v in evidence) for w in written)


_PAIR = re.compile(r"^\s*([\w./-]+)\s*[=:]\s*(.+?)\s*$")
_WORD = re.compile(r"[a-z][a-z0-9_/.+-]+")
_ABSENT = {"absent", "unset", "none", "null", "missing"}


def citation_valid(engine, kind: str, ref: str, quote: str, texts: dict[str, str]) -> bool:
    """The record exists, and its quote (when it gives one) is the record's own: a passage of its
    text, or `field=value` pairs whose values the record holds, or words and numbers it holds."""
    text = texts.get(f"{kind}:{ref}")
    if text is None:
        return False
    if not quote.strip() or _norm(quote) in _norm(text):
        return True
    stored = record_values(engine, [f"{kind}:{ref}"]).get(f"{kind}:{ref}")
    have = values_of(text) + values_of(stored)
    words_have = set(_WORD.findall(f"{text} {stored}".lower()))

    def holds(part: str, key: str = "") -> bool:
        value, leaf = part.strip().strip("'\"").lower(), key.rsplit(".", 1)[-1].lower()
        if key and value == "true":         # a flag or tag the record has (tags.baseline=true)
            return leaf in words_have or value in words_have
        if key and (value in _ABSENT or value == "false"):      # ... or lacks
            return leaf not in words_have or value in words_have
        numbers = numbers_in(part)
        words = set(_WORD.findall(re.sub(r"\d[\d.eE+-]*", " ", part.lower())))
        return all(any(matches(w, v) for v in have) for w in numbers) and \
            len(words & words_have) >= 0.6 * len(words)

    pairs = [_PAIR.match(p) for p in quote.split(",")]
    if all(pairs):          # the planner's quotes: `summary.val/loss=3.0534, status=diverged`
        return all(holds(m.group(2), m.group(1)) for m in pairs)
    return holds(quote)


def _close(w: Written, value: float) -> bool:
    if float(value).is_integer() and abs(value) < 1e6 and w.digits >= len(str(int(abs(value)))):
        return w.value == value
    return matches(w, value) and abs(w.value - value) <= EXACT_REL * abs(value) + 1e-12


def exact(text: str, expect: dict, labels: list[str]) -> tuple[bool, list[str]]:
    """Does the answer hold what a right answer must: the run (by id or name), the numbers, the
    count, the words; and none of the numbers it must not state."""
    body = plain(text)
    low = body.lower()
    written = numbers_in(body)
    problems = []
    if expect.get("run") or labels:
        names = [n.lower() for n in list(expect.get("run") or []) + labels]
        if not any(n in low for n in names):
            problems.append(f"run not named (want one of {names[:2]})")
    for value in expect.get("numbers", []):
        if not any(_close(w, value) for w in written):
            problems.append(f"missing number {value:g}")
    for value in expect.get("absent", []):
        if any(math.isclose(w.value, value, rel_tol=1e-6) for w in written):
            problems.append(f"states {value:g}, which it should not")
    if "count" in expect and not any(w.value == expect["count"] for w in written):
        problems.append(f"count {expect['count']} not stated")
    for group in expect.get("mentions", []):
        if not any(alt.lower() in low for alt in group):
            problems.append(f"does not mention {group[0]!r}")
    return not problems, problems
