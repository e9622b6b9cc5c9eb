"""The review side of the UI: the Hypotheses tab (review, approve with a reason, which queues the
hypothesis's jobs) and the Jobs tab (the queue, live loss curves of running jobs, cancel,
verdicts and reports), and the bounded live curve runner.execute keeps in a job's progress.

Layout helpers are tested on the API's real dicts; the browser tests drive a real `kb serve`
(tests/browser.py) while a real `kb worker` subprocess trains tiny proxy GPTs on CPU.

    pytest tests/test_ui_review.py -q
"""
from __future__ import annotations

import subprocess
import time

import pytest

from kb.hypotheses import store
from runner.execute import LiveCurve
from tests.browser import KB, TIMEOUT_MS, browser, page_of, serve_ui, server_env, shot  # noqa: F401 - a fixture

TINY = {"n_layer": 1, "seq_len": 32, "batch_size": 8, "max_steps": 40, "eval_interval": 10, "eval_batches": 2,
        "threads": 1, "checkpoint_interval": 0}


def baseline_run(k, project: str = "p") -> str:
    """A real tiny proxy training, run in this process; its run id."""
    [job] = k.submit(config=TINY, backend="inline", project=project)
    k.work(backend="inline")
    return k.job(job["id"])["run"]


def hypothesis(k, baseline: str, **over) -> dict:
    row = dict(id="hyp-lr-up", title="Raise the learning rate to 1e-2", rationale="lr 4e-3 was the best of the "
               "sweep and still rising [" + baseline + "]", baseline_run=baseline, change={"lr": 1e-2},
               evidence=[baseline, "abl-lr-0123456789"], status="proposed", project="p", source="surrogate",
               predicted={"metric": "val/loss", "delta": -0.05, "interval": [-0.09, -0.01], "level": 0.95,
                          "method": "gp surrogate"},
               risks=["lr 0.01: run-diverged diverged at step 30 with lr 0.02 (same project) [run-diverged]"],
               plan={"scales": [{"params": 1e5}], "seeds": 2, "steps": 40, "runs": 4, "why": "two seeds per side"})
    [h] = store(k.engine, [row | over])
    return h


# ---- the live curve in a job's progress ---------------------------------------------------------

def test_the_live_curve_keeps_losses_only_bounded_and_spanning_every_step():
    curve = LiveCurve(limit=20)
    for step in range(0, 1000, 5):
        out = curve.add(step, {"train/loss": 3.0 - step / 1000, "val/loss": 3.1 - step / 1000, "lr": 1e-3})
    assert set(out) == {"train/loss", "val/loss"}           # lr stays in progress["metrics"] only
    steps = [p[0] for p in out["val/loss"]]
    assert len(steps) <= 20 and steps[0] == 0 and steps[-1] == 995 and steps == sorted(steps)
    assert len(steps) >= 10 and len({b - a for a, b in zip(steps[:-2], steps[1:-1])}) == 1   # evenly spaced
    # a resumed attempt starts from the stored curve and goes over the steps after its checkpoint again
    again = LiveCurve(out, limit=20).add(900, {"val/loss": 9.0})
    assert again["val/loss"][-1] == [900, 9.0] and all(s < 900 for s, _ in again["val/loss"][:-1])


def test_a_jobs_progress_carries_its_loss_curve_which_the_jobs_figure_draws(kb):
    from kb.ui.jobs import curve_figure, job_curves, job_markdown, job_rows
    seen = []
    [job] = kb.submit(config=TINY, backend="inline", project="p")
    kb.work(backend="inline", on_progress=lambda job_id, p: seen.append(p))
    assert [p["step"] for p in seen] == [10, 20, 30, 40]
    last = seen[-1]
    assert [s for s, _ in last["curve"]["val/loss"]] == [10, 20, 30, 40]
    assert [v for _, v in last["curve"]["val/loss"]] == [p["metrics"]["val/loss"] for p in seen]
    done = kb.job(job["id"])
    assert done["progress"]["curve"] == last["curve"]        # what `kb jobs --json` and /api/jobs/ID give
    live = curve_figure(job_curves(done))                     # drawn from the progress alone
    by_name = {t.name: t for t in live.data}
    assert list(by_name["val/loss"].x) == [10, 20, 30, 40] and "train/loss" in by_name
    run = kb.run(done["run"])                                 # once it has a run: its full curves
    full = {t.name: t for t in curve_figure(job_curves(done, run)).data}
    assert len(full["train/loss"].x) == 40 and list(full["val/loss"].x) == [10, 20, 30, 40]
    [row] = job_rows([done])
    assert row[0] == job["id"] and row[1] == "succeeded" and row[4] == "40 / 40"
    assert row[6] == f"[{done['run']}](?run={done['run']})"
    assert f"[{done['run']}](?run={done['run']})" in job_markdown(done)


# ---- hypotheses' layout -------------------------------------------------------------------------

def test_a_hypothesis_for_review_links_its_evidence_and_risks_and_diffs_its_change(kb):
    from kb.ui.hypotheses import hypothesis_markdown, hypothesis_rows, linked
    kb.ingest_records([{"id": "base-1", "project": "p", "config": {"lr": 4e-3, "optim": {"beta2": 0.95}},
                        "summary": {"val_loss": 3.0}}], index=False)
    h = hypothesis(kb, "base-1", change={"lr": 1e-2, "optim.beta2": 0.99, "qk_norm": True})
    text = hypothesis_markdown(h, kb.run("base-1").config)
    assert "### Raise the learning rate to 1e-2" in text
    assert "[base-1](?run=base-1)" in text                          # baseline, rationale and evidence
    assert "[abl-lr-0123456789](?ablation=abl-lr-0123456789)" in text
    assert "[run-diverged](?run=run-diverged)" in text              # a risk's citation
    assert "[hyp-lr-up](?hypothesis=hyp-lr-up)" in text
    assert "| `lr` | `0.004` | `0.01` |" in text and "| `optim.beta2` | `0.95` | `0.99` |" in text
    assert "| `qk_norm` | (absent) | `true` |" in text
    assert "val/loss -0.05 (95% interval -0.09 to -0.01)" in text and "2 seeds per side at params 1e+05" in text
    assert hypothesis_rows([h]) == [["hyp-lr-up", "proposed", "p", "surrogate",
                                     "val/loss -0.05 (95% interval -0.09 to -0.01)", h["title"]]]
    # a link already written stays as it is; an image is no citation
    assert linked("see [a](?run=a) and [b]; ![x](y.png)") == "see [a](?run=a) and [b](?run=b); ![x](y.png)"


def test_a_concluded_hypothesis_shows_its_verdict_with_its_runs():
    from kb.ui.hypotheses import result_markdown
    from kb.ui.jobs import report_markdown
    # runner.conclude's result, as its docstring gives it
    result = {"metric": "val/loss", "outcome": "better", "verified": False,
              "effect": {"delta": -0.12, "interval": [-0.2, -0.04], "level": 0.95, "method": "welch-t"},
              "scales": [{"params": 1e5, "outcome": "better", "delta": -0.12, "interval": [-0.2, -0.04],
                          "baseline_runs": ["run-b0", "run-b1"], "variant_runs": ["run-v0", "run-v1"]}],
              "transfer": None, "errors": []}
    text = result_markdown(result)
    assert text.startswith("**Verdict:** better on val/loss")
    assert "effect -0.12 (95% interval -0.2 to -0.04, welch-t)" in text
    assert all(f"[{r}](?run={r})" for r in ("run-b0", "run-v1")) and "[run-v1](?run=run-v1)" in text
    md = report_markdown("# Hypothesis hyp-1\n\n![curves](curves.png)\n\nbetter [run-b0] [hyp-1].\n")
    assert "curves.png" not in md and "[run-b0](?run=run-b0) [hyp-1](?hypothesis=hyp-1)" in md


# ---- in a browser -------------------------------------------------------------------------------

def expecting():
    """Playwright's expect, waiting as long as the pages do: an approval that queues jobs, or
    the first curve of a job, can take seconds on a busy 2-core machine."""
    from playwright.sync_api import expect
    expect.set_options(timeout=TIMEOUT_MS)
    return expect


def worker(home, backend: str) -> subprocess.Popen:
    """`kb worker --once` on the served home: it works until nothing is queued or running."""
    return subprocess.Popen([KB, "worker", "--once", "--backend", backend], env=server_env(home),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def plotted(page, elem: str) -> dict[str, list]:
    """The x values of every trace the plotly chart inside #elem draws now."""
    return page.locator(f"#{elem} .js-plotly-plot").evaluate(
        "el => Object.fromEntries(el.data.map(t => [t.name, Array.from(t.x || [])]))")


@pytest.mark.slow
def test_approving_in_the_ui_queues_jobs_which_the_jobs_tab_follows_to_a_verdict(browser, tmp_path):
    expect = expecting()
    from kb.api import KnowledgeBase
    from kb.settings import Settings
    home = tmp_path / "home"
    with KnowledgeBase.open(Settings(home=home)) as k:
        base = baseline_run(k)
        hypothesis(k, base)
    with serve_ui(home) as url, page_of(browser, f"{url}/ui/?hypothesis=hyp-lr-up") as page:
        detail = page.locator("#hypothesis-detail")
        expect(detail).to_contain_text("Raise the learning rate to 1e-2")
        expect(detail.get_by_role("link", name="abl-lr-0123456789")).to_have_attribute(
            "href", "?ablation=abl-lr-0123456789")
        expect(detail.get_by_role("link", name=base).first).to_have_attribute("href", f"?run={base}")
        page.locator("#hypothesis-reason textarea").fill("cheap, and the sweep was still improving")
        page.get_by_label("Run its jobs on").click()
        page.get_by_role("option", name="inline").click()
        shot(page, "hypotheses-review", tmp_path)
        page.locator("#hypothesis-approve").click()
        said = page.locator("#hypothesis-message")
        expect(said).to_contain_text("approved by")
        expect(said).to_contain_text("job(s) queued on inline")
        expect(detail).to_contain_text("cheap, and the sweep was still improving")

        page.get_by_role("tab", name="Jobs").click()
        table = page.locator("#jobs-table")
        expect(table).to_contain_text("hyp-lr-up-variant-d1-s0")     # the approved plan's jobs, queued
        expect(table).to_contain_text("queued")
        table.get_by_text("hyp-lr-up-variant-d1-s1").click()
        expect(page.locator("#job-detail")).to_contain_text("queued")
        expect(page.locator("#job-verdict")).to_contain_text("is running")

        run = worker(home, "inline")
        try:
            assert run.wait(timeout=300) == 0, run.stderr.read()
        finally:
            run.kill() if run.poll() is None else None
        verdict = page.locator("#job-verdict")                        # the timer redraws it
        expect(verdict).to_contain_text("Verdict:", timeout=60_000)
        expect(page.locator("#job-detail")).to_contain_text("succeeded")
        expect(page.locator("#job-hypothesis input, #job-hypothesis textarea").first).to_have_value("hyp-lr-up")
        page.locator("#job-report-button").click()
        report = page.locator("#job-report")
        expect(report).to_contain_text("Hypothesis hyp-lr-up: Raise the learning rate to 1e-2")
        expect(report.get_by_role("link", name=base).first).to_have_attribute("href", f"?run={base}")


@pytest.mark.slow
def test_a_running_jobs_curve_grows_on_the_page_and_cancel_stops_it(browser, tmp_path):
    expect = expecting()
    from kb.api import KnowledgeBase
    from kb.settings import Settings
    home = tmp_path / "home"
    with KnowledgeBase.open(Settings(home=home)) as k:
        # long enough to be watched: it runs until the test cancels it
        [job] = k.submit(config={**TINY, "max_steps": 1_000_000, "eval_interval": 20}, backend="local",
                         project="live", name="watched")
    with serve_ui(home) as url:
        run = worker(home, "local")
        try:
            with page_of(browser, f"{url}/ui/?job={job['id']}") as page:
                detail = page.locator("#job-detail")
                expect(detail).to_contain_text("running", timeout=120_000)
                first = last_step(page, after=0)
                later = last_step(page, after=first)                 # the timer redrew it with more points
                assert later > first
                shot(page, "jobs-live", tmp_path)
                page.locator("#job-cancel").click()
                expect(detail).to_contain_text("cancelled", timeout=60_000)
            assert run.wait(timeout=120) == 0, run.stderr.read()
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
    with KnowledgeBase.open(Settings(home=home)) as k:
        done = k.job(job["id"])
        assert done["status"] == "cancelled" and done["run"] is None
        assert done["progress"]["curve"]["val/loss"][-1][0] >= later


def last_step(page, after: int, patience_s: float = 120) -> int:
    """The last step the page's val/loss curve shows, once it is past `after`."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            xs = plotted(page, "job-curve").get("val/loss") or []
        except Exception:              # noqa: BLE001 - the chart is being redrawn
            xs = []
        if xs and xs[-1] > after:
            return xs[-1]
        assert time.monotonic() < deadline, f"the curve on the page did not pass step {after}"
        page.wait_for_timeout(500)
