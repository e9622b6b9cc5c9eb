"""The Chat tab: answers rendered with their citations as links and the SQL folded, abstentions
shown as such, proposals linked to the Hypotheses tab, the lock held across a streamed answer;
then in a real browser against a real `kb serve` (no language model: the agent answers from SQL
and by extraction, as tests/test_server.py runs it): a question on an lr sweep gets an answer
whose citation opens the cited run, and a question about nothing in the store says so.

    pytest tests/test_ui_chat.py -q
"""
from __future__ import annotations

import threading

import pytest

from agents.evidence import NO_EVIDENCE
from kb.ui.answers import answer_markdown, is_abstention, proposals_markdown
from kb.ui.chat import locked_stream, proposal_goal
from tests.browser import browser, page_of, serve_ui, shot  # noqa: F401 - browser is a fixture
from tests.test_ui_runs import filled_home


def test_citations_render_as_links_to_their_records():
    md = answer_markdown({"answer": "Run lr_a had the lowest loss [1]. A note says lr was high [2][3]. See [4].",
                          "citations": [{"kind": "run", "id": "lr_a", "quote": "val/loss=3.01"},
                                        {"kind": "note", "id": "note-9", "quote": ""},
                                        {"kind": "ablation", "id": "abl-lr-1", "quote": "lr varied"},
                                        {"kind": "failure", "id": "7", "quote": "x" * 300}],
                          "sql": "SELECT id FROM run ORDER BY 1"})
    first = md.splitlines()[0]
    assert first.startswith("Run lr\\_a had the lowest loss [\\[1\\]](?run=lr_a \"run lr_a\").")
    assert "[\\[2\\]](?note=note-9 \"note note-9\")[\\[3\\]](?ablation=abl-lr-1" in first
    assert "[\\[4\\]](?failure=7 \"failure 7\")" in first
    assert "1. run [lr\\_a](?run=lr_a) — “val/loss=3.01”" in md and "2. note [note-9](?note=note-9)\n" in md
    assert "4. failure [7](?failure=7) — “" + "x" * 159 + "…”" in md        # long quotes shortened
    details = md[md.index("<details>"):]
    assert "<summary>SQL the agent ran</summary>" in details and "```sql\nSELECT id FROM run ORDER BY 1\n```" in details
    assert "No evidence" not in md


def test_an_abstention_is_shown_as_no_evidence():
    answer = {"answer": NO_EVIDENCE, "citations": [], "sql": None}
    md = answer_markdown(answer)
    assert is_abstention(answer) and md.startswith("> **∅ No evidence.**") and "](?" not in md
    # an answer from SQL with no row to cite is still an answer, not an abstention
    assert not is_abstention({"answer": "No run matches.", "citations": [], "sql": "SELECT 1"})


def test_proposals_link_to_the_hypotheses_tab():
    md = proposals_markdown([{"id": "hyp-1", "title": "lr 1e-3 -> 8e-4", "change": {"optim.lr": 8e-4},
                              "predicted": {"metric": "val/loss", "delta": -0.012, "interval": [-0.03, 0.004]},
                              "baseline_run": "r1", "rationale": "a GP fit says so"}], goal="lower val/loss")
    assert "[lr 1e-3 -\\> 8e-4](?hypothesis=hyp-1)" in md and "`optim.lr` → 0.0008" in md
    assert "predicted val/loss Δ -0.012 (interval -0.03 to 0.004)" in md and "[r1](?run=r1)" in md
    assert "No proposals" in proposals_markdown([], goal="x")


def test_a_message_asking_for_proposals_names_its_goal():
    assert proposal_goal("Propose experiments to lower val/loss") == "lower val/loss"
    assert proposal_goal("please suggest hypotheses for: faster convergence") == "faster convergence"
    assert proposal_goal("propose") == ""
    assert proposal_goal("propose tokens per step") == "tokens per step"        # "to" only as a word
    assert proposal_goal("Which lr diverged?") is None and proposal_goal("suggestions?") is None


def test_the_lock_is_held_by_one_thread_across_the_whole_stream():
    lock = threading.RLock()
    seen = []

    def free_elsewhere() -> bool:
        """Could another thread take the lock now?"""
        got = []

        def probe():
            took = lock.acquire(blocking=False)
            if took:
                lock.release()
            got.append(took)

        thread = threading.Thread(target=probe)
        thread.start()
        thread.join()
        return got[0]

    def pieces():
        for word in ("a ", "b ", "c"):
            seen.append((threading.get_ident(), free_elsewhere()))
            yield word

    assert "".join(locked_stream(lock, pieces)) == "a b c"
    # every piece made in one thread (an RLock is released by the thread that took it), none free
    assert len({ident for ident, _ in seen}) == 1 and seen[0][0] != threading.get_ident()
    assert [free for _, free in seen] == [False, False, False]
    assert free_elsewhere()               # released when the stream ends

    def failing():
        yield "x"
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        list(locked_stream(lock, failing))
    assert free_elsewhere()


@pytest.mark.slow
def test_an_answer_cites_a_run_that_opens_on_click(browser, tmp_path):
    home = filled_home(tmp_path / "home")
    with serve_ui(home, KB_LLM_BACKEND="none-in-these-tests") as url, page_of(browser, f"{url}/ui/") as page:
        chat = page.locator("#kb-chat")
        box = page.locator("#kb-chat-input textarea")
        box.fill("Which learning rate gave the lowest val/loss?")
        box.press("Enter")
        best = chat.locator("a[href='?run=lr0.001-s1']").first       # lr 1e-3, seed 1: the lowest loss
        best.wait_for()
        assert chat.locator("details summary").get_by_text("SQL the agent ran").is_visible()
        shot(page, "chat-answer", tmp_path)

        box.fill("What did the speech team learn about beam search width?")
        box.press("Enter")
        chat.get_by_text("No evidence").wait_for()

        # a citation opens in a new tab (Gradio's Markdown links do), on the Runs tab with the run shown
        with page.context.expect_page() as opened:
            best.click()
        run_page = opened.value
        run_page.locator("#kb-record-body").get_by_text("lr0.001-s1").first.wait_for()
        assert run_page.get_by_role("tab", name="Runs", selected=True).is_visible()
        assert run_page.locator("#kb-record-body").get_by_text("optim.lr").first.is_visible()
