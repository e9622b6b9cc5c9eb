"""The QA quality regression test: a slice of benchmarks/qa_eval.py, failing when answer quality
drops. The "ci" history (~95 runs in 5 projects, notes, an MLflow store written by MlflowClient
and a TensorBoard tree written by SummaryWriter, both ingested through `kb ingest`)
and ~40 of its questions across every shape, answered by KnowledgeBase.ask / chat and scored
exactly as the harness scores: real SQLite and Postgres, real embedded Qdrant, real MiniLM, the
real embedded LLM. The first tests check the scoring rules themselves, on hand-written answers.

    pytest tests/test_qa_quality.py -q
"""
from __future__ import annotations

import pytest

from benchmarks.qa_questions import QUANTITATIVE, make_questions, stratified
from benchmarks.qa_scoring import abstained, exact, faithfulness, retrieval
from tests.conftest import BACKENDS, database

N_QUESTIONS = 40
# The targets, which the agent meets on this slice (measured 2026-12-03: recall@5 0.988,
# citation validity 1.0, quantitative accuracy 1.0, numeric faithfulness 1.0, abstention 0.987
# balanced); recall is a little below its target on purpose, since a paraphrase the ranking
# misses is not a wrong answer.
MIN_RECALL5 = 0.95
MIN_RECALL5_RETRIEVED = 0.9      # on the shapes answered from retrieval and explanations: 0.967
MIN_CITATION_VALIDITY = 1.0
MIN_QUANTITATIVE = 0.95
MIN_ABSTENTION = 0.9


# ---- the scoring rules ------------------------------------------------------------------------------

def test_exact_answer_needs_the_run_and_its_numbers_in_any_spelling():
    expect = {"run": ["sw-125m-lr6e-4-wu2000-b256-s1"], "numbers": [6e-4, 3.0534]}
    good = "Run sw-125m-lr6e-4-wu2000-b256-s1 has the lowest val/loss, 3.053, at lr 0.0006 [1]."
    assert exact(good, expect, [])[0]
    assert not exact(good.replace("3.053", "3.12"), expect, [])[0]              # wrong value
    assert not exact(good.replace("s1 has", "s0 has"), expect, [])[0]           # wrong run
    assert not exact("Run sw-125m-lr6e-4-wu2000-b256-s1 has val/loss 3 [1].", expect, [])[0]   # too coarse


def test_counts_lists_and_words():
    assert exact("There are 12 runs [1].", {"count": 12}, [])[0]
    assert not exact("There are 13 runs [12].", {"count": 12}, [])[0]         # a marker is not a count
    lrs = {"numbers": [3e-3, 6e-3], "absent": [1e-3]}
    assert exact("lr 3e-3 and 0.006 diverged.", lrs, [])[0]
    assert not exact("lr 3e-3, 6e-3 and 1e-3 diverged.", lrs, [])[0]
    assert exact("They differ in optim.warmup_steps.", {"mentions": [["warmup"]]}, [])[0]


def test_faithfulness_counts_numbers_the_evidence_lacks():
    evidence = [125_000_000.0, 0.0003, 3.05341]
    assert faithfulness("The 125M run at lr 3e-4 reached 3.053 [1].", evidence) == (3, 3)
    assert faithfulness("The 125M run at lr 3e-4 reached 2.9 [1].", evidence) == (3, 2)


def test_retrieval_and_abstention_measures():
    assert retrieval(["run:a", "note:b", "run:c"], {"run:c"}) == (1.0, 1 / 3)
    assert retrieval(["run:x"] * 5 + ["run:c"], {"run:c", "run:d"}) == (0.0, 1 / 6)
    assert abstained("I found no evidence for that in the knowledge base.")
    assert not abstained("Run a diverged at step 1200 [1].")


# ---- the agent on the slice --------------------------------------------------------------------------

@pytest.fixture(scope="module", params=BACKENDS)
def scored(request, tmp_path_factory):
    from benchmarks.qa_eval import eval_agent, summarize
    from benchmarks.qa_build import build
    from benchmarks.qa_history import make_history
    from benchmarks.qa_scoring import resolve
    from kb.api import KnowledgeBase
    from kb.settings import Settings

    tmp = tmp_path_factory.mktemp("qa")
    with database(request.param, tmp) as url:
        k = KnowledgeBase.open(Settings(home=tmp / "home", database_url=url))
        try:
            h = make_history("ci")
            build(k, h, tmp / "sources")
            questions = stratified(make_questions(h), N_QUESTIONS)
            golds = {q.id: resolve(k.engine, q.gold) for q in questions}
            before = k.count()
            scores = eval_agent(k, questions, golds)
            summary = summarize(scores)
            print({key: v for key, v in summary.items() if key != "shapes"})      # shown when a test fails
            yield {"summary": summary, "scores": scores, "unchanged": before == k.count()}
        finally:
            k.close()


def _failing(scores, keep) -> str:
    """The questions behind a failed threshold, one line each, for the assertion message."""
    return "\n".join(f"{s.qid}: {'; '.join(s.problems) or s.text[:160]}" for s in scores if keep(s))


def test_retrieval_finds_the_gold_records(scored):
    """Overall, and on the questions answered from what was retrieved (explanations, notes, named
    runs): superlatives and counts are answered from SQL, whatever retrieval ranks first."""
    s = scored["summary"]
    assert s["retrieval_scored"] >= 20
    assert s["recall5"] >= MIN_RECALL5, _failing(scored["scores"], lambda x: x.recall5 is not None and x.recall5 < 1)
    assert s["recall5_other"] >= MIN_RECALL5_RETRIEVED, _failing(
        scored["scores"], lambda x: x.shape not in QUANTITATIVE and x.recall5 is not None and x.recall5 < 1)


def test_every_citation_names_a_record_that_supports_it(scored):
    s = scored["summary"]
    assert s["citations"] > 0
    assert s["citation_validity"] >= MIN_CITATION_VALIDITY, _failing(scored["scores"], lambda x: x.valid_citations < x.citations)


def test_every_number_in_an_answer_was_measured(scored):
    assert scored["summary"]["numeric_faithfulness"] == 1.0, _failing(scored["scores"], lambda x: not x.faithful)


def test_quantitative_answers_are_exact(scored):
    s = scored["summary"]
    assert s["quantitative_n"] >= 15
    assert s["quantitative_accuracy"] >= MIN_QUANTITATIVE, _failing(
        scored["scores"], lambda x: x.shape in QUANTITATIVE and x.exact is False)


def test_unanswerables_abstain_and_answerables_do_not(scored):
    s = scored["summary"]
    assert s["unanswerable"] >= 3
    assert s["abstention_accuracy"] >= MIN_ABSTENTION, _failing(
        scored["scores"], lambda x: x.abstained == x.answerable or (not x.answerable and x.citations))


def test_asking_changes_nothing_in_the_store(scored):
    assert scored["unchanged"]          # the history holds a note telling the agent to delete all runs
