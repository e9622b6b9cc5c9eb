"""The QA evaluation: the agent (KnowledgeBase.ask, its hybrid Retriever) against a dense-only
llama-index baseline, on a generated history whose facts are known.

    python benchmarks/qa_eval.py                      # builds the full history (500+ runs) in a temp home
    python benchmarks/qa_eval.py --home /tmp/qa       # builds it there once, reuses it after
    python benchmarks/qa_eval.py --limit 40 --json    # a stratified slice; one JSON object as the last line
    python benchmarks/qa_eval.py --questions qs.json  # your own questions (the shape qa_questions writes)

The history (benchmarks/qa_history.py) is 500 native runs, 12 runs written by MlflowClient and 8
by torch's SummaryWriter (ingested with `kb ingest`), and 10 notes; the questions
(benchmarks/qa_questions.py) carry answers computed from the generated facts. Both systems use
the same chunks, the same MiniLM embeddings and the same LLM (agents.llm.get_llm: the embedded
SmolLM2-135M unless KB_LLM_* say otherwise). Printed for each: retrieval recall@5 and MRR,
citation validity, numeric faithfulness, exact-answer accuracy on quantitative questions,
abstention accuracy, p50 latencies, and a per-shape breakdown, with the targets beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")

from agents.corpus import chunks_by_key  # noqa: E402
from benchmarks.qa_build import KB_COMMAND, build  # noqa: E402
from benchmarks.qa_history import make_history  # noqa: E402
from benchmarks.qa_questions import QUANTITATIVE, Question, from_dicts, make_questions, stratified  # noqa: E402
from benchmarks.qa_scoring import (Scored, abstained, citation_valid, evidence_values, exact,  # noqa: E402
                                   faithfulness, resolve, retrieval, run_labels)

TARGETS = {"recall5": (">=", 0.95), "citation_validity": ("=", 1.0), "numeric_faithfulness": ("=", 1.0),
           "quantitative_accuracy": (">=", 0.95), "abstention_accuracy": (">=", 0.9), "ask_p50_s": ("<=", 3.0)}


# ---- the history ----------------------------------------------------------------------------------

def prepare(kb, plan: str, home: Path) -> list[Question]:
    """The questions, building the history into `kb` first unless this home already holds it."""
    saved = home / "qa" / "questions.json"
    if saved.exists() and kb.count()["runs"]:
        return from_dicts(json.loads(saved.read_text()))
    h = make_history(plan)
    t = time.perf_counter()
    build(kb, h, home / "sources")
    print(f"built the {plan} history in {time.perf_counter() - t:.0f} s: {kb.count()}", flush=True)
    questions = make_questions(h)
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps([q.as_dict() for q in questions], indent=1))
    return questions


# ---- scoring one system ------------------------------------------------------------------------------

def score(kb, q: Question, gold: set[str], ranked: list[str] | None, text: str, cites: list[tuple[str, str, str]],
          rows=None, sql: str | None = None, texts: dict[str, str] | None = None) -> Scored:
    s = Scored(q.id, q.shape, q.answerable, text=text,
               raw={"ranked": ranked, "cites": cites, "rows": rows, "sql": sql, "texts": texts})
    if ranked is not None and gold and not q.history:
        s.recall5, s.rr = retrieval(ranked, gold)
    keys = [f"{k}:{i}" for k, i, _ in cites]
    texts = {**{k: c.text for k, c in chunks_by_key(kb.engine, keys).items()}, **{
        k: v for k, v in (texts or {}).items() if k in keys}}
    s.citations = len(cites)
    s.valid_citations = 0 if not q.answerable else sum(
        citation_valid(kb.engine, k, i, quote, texts) for k, i, quote in cites)
    s.numbers, s.supported_numbers = faithfulness(text, evidence_values(kb.engine, keys, rows, sql, q.text, texts))
    s.faithful = s.numbers == s.supported_numbers
    s.abstained = abstained(text)
    if q.answerable and gold:
        s.cites_gold = bool(set(keys) & gold)
    if q.answerable and q.expect:
        labels = run_labels(kb.engine, {k for k in gold if k.startswith("run:")}) if "run" in q.expect else []
        s.exact, s.problems = exact(text, q.expect, labels)
    if s.numbers != s.supported_numbers:
        s.problems.append(f"{s.numbers - s.supported_numbers} unsupported number(s)")
    return s


def eval_agent(kb, questions: list[Question], golds: dict[str, set[str]], progress=None) -> list[Scored]:
    retriever = kb._retriever()         # the very Retriever that ask() uses, timed alone
    retriever.retrieve("warm up: load the keyword index and the embedding model", k=5)
    kb.ask("Which learning rate gave the lowest val loss?")        # loads the LLM
    out = []
    for i, q in enumerate(questions):
        t = time.perf_counter()
        ranked = [h.key for h in retriever.retrieve(q.text, k=10)]
        retrieve_ms = (time.perf_counter() - t) * 1000
        chat = kb.chat()
        for earlier in q.history:
            chat.ask(earlier)
        t = time.perf_counter()
        answer = chat.ask(q.text)
        answer_ms = (time.perf_counter() - t) * 1000
        # the agent's retrieval is what it read to answer (the SQL's runs for a planned question,
        # the diffed runs for an explanation, the hybrid hits otherwise); the hybrid retriever
        # alone is scored beside it
        read = answer.retrieved or ranked
        s = score(kb, q, golds[q.id], read, answer.text, [(c.kind, c.id, c.quote) for c in answer.citations],
                  answer.rows, answer.sql)
        if golds[q.id] and not q.history:
            s.raw["hybrid"] = ranked
            s.hybrid_recall5 = retrieval(ranked, golds[q.id])[0]
        s.retrieve_ms, s.answer_ms = retrieve_ms, answer_ms
        out.append(s)
        if progress:
            progress("agent", i + 1, len(questions), s)
    return out


def eval_baseline(kb, questions: list[Question], golds: dict[str, set[str]], llm, progress=None) -> list[Scored]:
    from benchmarks.qa_baseline import Baseline
    base = Baseline(kb, llm)
    base.retrieve("warm up")
    out = []
    for i, q in enumerate(questions):
        t = time.perf_counter()
        ranked = base.retrieve(q.text)
        retrieve_ms = (time.perf_counter() - t) * 1000
        text, cites, answer_ms = "", [], None
        if base.engine is not None:
            t = time.perf_counter()
            text, cites = base.ask(q.text)          # a query engine keeps no conversation
            answer_ms = (time.perf_counter() - t) * 1000
        s = score(kb, q, golds[q.id], ranked, text, cites)
        s.retrieve_ms, s.answer_ms = retrieve_ms, answer_ms
        out.append(s)
        if progress:
            progress("baseline", i + 1, len(questions), s)
    return out


def rescore(kb, questions: list[Question], golds: dict[str, set[str]], saved: list[dict]) -> list[Scored]:
    """Score saved answers again (after a change to the scoring), keeping their timings."""
    by_id = {q.id: q for q in questions}
    out = []
    for old in saved:
        q, raw = by_id[old["qid"]], old["raw"]
        s = score(kb, q, golds[q.id], raw["ranked"], old["text"], [tuple(c) for c in raw["cites"]], raw["rows"],
                  raw["sql"], raw["texts"])
        if raw.get("hybrid") is not None:
            s.raw["hybrid"] = raw["hybrid"]
            s.hybrid_recall5 = retrieval(raw["hybrid"], golds[q.id])[0]
        s.retrieve_ms, s.answer_ms = old["retrieve_ms"], old["answer_ms"]
        out.append(s)
    return out


# ---- the figures -----------------------------------------------------------------------------------

def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _p50(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(scored: list[Scored]) -> dict:
    answerable = [s for s in scored if s.answerable]
    unanswerable = [s for s in scored if not s.answerable]
    cites = sum(s.citations for s in scored)
    numbers = sum(s.numbers for s in scored)
    quant = [s for s in answerable if s.shape in QUANTITATIVE and s.exact is not None]
    out = {
        "questions": len(scored), "unanswerable": len(unanswerable),
        "recall5": _mean(s.recall5 for s in scored), "mrr": _mean(s.rr for s in scored),
        # superlatives and counts are answered from SQL, not from what was retrieved: shown apart
        "recall5_quantitative": _mean(s.recall5 for s in scored if s.shape in QUANTITATIVE),
        "recall5_other": _mean(s.recall5 for s in scored if s.shape not in QUANTITATIVE),
        "retrieval_scored": sum(s.recall5 is not None for s in scored),
        "recall5_hybrid_alone": _mean(s.hybrid_recall5 for s in scored),
        "citations": cites,
        "citation_validity": sum(s.valid_citations for s in scored) / cites if cites else None,
        "numbers": numbers,
        "numeric_faithfulness": sum(s.supported_numbers for s in scored) / numbers if numbers else None,
        "answers_faithful": _mean(float(s.faithful) for s in scored),
        "quantitative_accuracy": _mean(float(s.exact) for s in quant), "quantitative_n": len(quant),
        "answer_accuracy": _mean(float(s.exact) for s in answerable if s.exact is not None),
        "cites_gold": _mean(float(s.cites_gold) for s in answerable if s.cites_gold is not None),
        "unanswerable_abstained": _mean(float(s.abstained and not s.citations) for s in unanswerable),
        "answerable_answered": _mean(float(not s.abstained) for s in answerable),
        "retrieve_p50_ms": _p50(s.retrieve_ms for s in scored),
        "ask_p50_s": (_p50(s.answer_ms for s in scored) or 0) / 1000 or None,
    }
    # balanced over the two kinds of question: a system that never abstains scores 0.5, however
    # few unanswerables the set holds
    parts = [out["unanswerable_abstained"], out["answerable_answered"]]
    out["abstention_accuracy"] = _mean(p for p in parts if p is not None)
    shapes = {}
    for shape in dict.fromkeys(s.shape for s in scored):
        group = [s for s in scored if s.shape == shape]
        shapes[shape] = {"n": len(group), "recall5": _mean(s.recall5 for s in group),
                         "exact": _mean(float(s.exact) for s in group if s.exact is not None),
                         "faithful": _mean(float(s.faithful) for s in group),
                         "abstained": _mean(float(s.abstained) for s in group),
                         "cites_gold": _mean(float(s.cites_gold) for s in group if s.cites_gold is not None)}
    out["shapes"] = shapes
    return out


def _f(v, pct: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if not pct else f"{100 * v:.1f}%"


def print_report(agent: dict, base: dict | None, extra: dict) -> None:
    rows = [("retrieval recall@5", "recall5", ">= 0.95"),
            ("  on quantitative questions", "recall5_quantitative", ""),
            ("  on the other questions", "recall5_other", ""),
            ("  the hybrid retriever alone", "recall5_hybrid_alone", ""), ("retrieval MRR@10", "mrr", ""),
            ("citation validity", "citation_validity", "100%"), ("  citations made", "citations", ""),
            ("numeric faithfulness (numbers)", "numeric_faithfulness", "100%"),
            ("  answers with every number supported", "answers_faithful", ""),
            ("quantitative exact-answer accuracy", "quantitative_accuracy", ">= 0.95"),
            ("  all questions with one right answer", "answer_accuracy", ""),
            ("answers citing a gold record", "cites_gold", ""),
            ("abstention accuracy (balanced)", "abstention_accuracy", ">= 0.90"),
            ("  unanswerables abstained, nothing cited", "unanswerable_abstained", ""),
            ("  answerables answered", "answerable_answered", ""),
            ("retrieval p50 (ms)", "retrieve_p50_ms", ""), ("ask p50 (s)", "ask_p50_s", "<= 3 s")]
    print(f"\n{'':42s} {'agent':>10s} {'baseline':>10s}   target")
    for label, key, target in rows:
        a, b = agent.get(key), (base or {}).get(key)
        fmt = (lambda v: "-" if v is None else str(v)) if key == "citations" else \
            (lambda v: "-" if v is None else f"{v:.1f}" if key == "retrieve_p50_ms" else _f(v))
        print(f"{label:42s} {fmt(a):>10s} {fmt(b):>10s}   {target}")
    for k, v in extra.items():
        print(f"{k:42s} {v}")
    print("\nper shape (agent | baseline): n, recall@5, exact, faithful, abstained")
    for shape, a in agent["shapes"].items():
        b = (base or {}).get("shapes", {}).get(shape, {})
        print(f"  {shape:14s} {a['n']:3d}   {_f(a['recall5'])} {_f(a['exact'])} {_f(a['faithful'])} "
              f"{_f(a['abstained'])}  |  {_f(b.get('recall5'))} {_f(b.get('exact'))} {_f(b.get('faithful'))} "
              f"{_f(b.get('abstained'))}")


def cli_p50(home: Path, questions: list[Question], n: int) -> float | None:
    """`kb ask "..." --json` end to end, as a user runs it (process start and model loads included)."""
    env = dict(os.environ, KB_HOME=str(home))
    times = []
    for q in [q for q in questions if q.answerable and not q.history][:n]:
        t = time.perf_counter()
        proc = subprocess.run([*KB_COMMAND, "ask", q.text, "--json"], env=env, capture_output=True, text=True,
                              timeout=300)
        times.append(time.perf_counter() - t)
        if proc.returncode != 0:
            print(f"kb ask exited {proc.returncode}: {proc.stderr.strip()[-300:]}", file=sys.stderr)
    return statistics.median(times) if times else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", type=Path, help="KB_HOME to build the history in (reused when it holds one)")
    ap.add_argument("--plan", default="full", choices=("full", "ci"))
    ap.add_argument("--limit", type=int, help="a stratified slice of N questions")
    ap.add_argument("--questions", type=Path, help="a JSON list of questions instead of the generated ones")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--cli-samples", type=int, default=5, help="`kb ask` subprocess runs timed (0: skip)")
    ap.add_argument("--details", type=Path, help="write every question's scores and answers here (JSON)")
    ap.add_argument("--rescore", type=Path, help="score the answers saved by --details again, asking nothing")
    ap.add_argument("--json", action="store_true", help="one JSON object as the last stdout line")
    args = ap.parse_args()

    import torch
    torch.set_num_threads(1)
    from kb.api import KnowledgeBase
    from kb.settings import Settings

    home = args.home or Path(tempfile.mkdtemp(prefix="kb-qa-eval-"))
    kb = KnowledgeBase.open(Settings(home=home))
    questions = prepare(kb, args.plan, home)
    if args.questions:
        questions = from_dicts(json.loads(args.questions.read_text()))
    if args.limit:
        questions = stratified(questions, args.limit)
    golds = {q.id: resolve(kb.engine, q.gold) for q in questions}
    before = kb.count()
    print(f"{len(questions)} questions ({sum(not q.answerable for q in questions)} unanswerable) over "
          f"{before['runs']} runs and {before['notes']} note chunks", flush=True)

    def progress(who, i, n, s):
        if i % 20 == 0 or i == n:
            print(f"  {who}: {i}/{n}", flush=True)

    if args.rescore:
        saved = json.loads(args.rescore.read_text())
        questions = [q for q in questions if q.id in {s["qid"] for s in saved["agent"]}]
        agent_scores = rescore(kb, questions, golds, saved["agent"])
        base_scores = rescore(kb, questions, golds, saved["baseline"]) if saved["baseline"] else None
    else:
        agent_scores = eval_agent(kb, questions, golds, progress)
        base_scores = None
        if not args.no_baseline:
            from agents.llm import get_llm
            base_scores = eval_baseline(kb, questions, golds, get_llm(kb.settings), progress)
    after = kb.count()
    kb.close()
    extra = {"store unchanged by the questions (injection note)": str(before == after),
             "load average (other work shares the cores)": f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"}
    if args.cli_samples and not args.rescore:
        p50 = cli_p50(home, questions, args.cli_samples)
        extra[f"`kb ask` CLI p50 over {args.cli_samples} (s, process start incl.)"] = _f(p50)
    agent, base = summarize(agent_scores), summarize(base_scores) if base_scores else None
    print_report(agent, base, extra)
    if args.details:
        args.details.write_text(json.dumps({"agent": [vars(s) for s in agent_scores],
                                            "baseline": [vars(s) for s in base_scores or []]}, indent=1, default=str))
    if args.json:
        print(json.dumps({"agent": agent, "baseline": base, "targets": TARGETS, "extra": extra}))


if __name__ == "__main__":
    main()
