"""The experiment loop: propose -> approve -> submit -> run -> verdict, repeated, then a report.

    kb loop --project tiny --config tiny.yaml --rounds 3 --approve auto
    report = k.loop(project="tiny", config=cfg, rounds=3, approve="auto", backend="inline")

Stages of a round:
    1. propose   agents.propose over the project's runs (n proposals; InsufficientData: the loop
                 stops, proposals ran dry)
    2. approve   auto: the policy below approves one, recorded as decided by "kb loop (auto)" with
                 the reason; manual: the proposals are printed and the loop polls until a person
                 approves one (`kb approve HYP`) or rejects them all (then it proposes again)
    3. run       its plan is queued (runner.submit) and run by a worker on `backend` in this
                 process, until every job of the hypothesis has finished (other workers may help)
    4. verdict   runner.conclude stores the result on the hypothesis; a change better than seed
                 noise at its first scale but not yet measured at a second one is run again at the
                 project's next larger scale: only a gain seen at two scales is kept (verified)

Auto policy: the proposer's top-ranked proposal (best predicted gain first, sources in turn) whose
plan fits the run budget; with none fitting, the top-ranked one.

A project with no runs starts from `config`: the starting baseline (tagged `loop:baseline`) at its
depth with two seeds, the same at lr / 3 and 3 x lr (a sweep for the surrogate to read), and at the
next depth (so plans can check a gain at a second scale). A rerun continues from the store: it
starts no second baseline, and the proposer never proposes a configuration the store or an earlier
hypothesis holds, so nothing tried is tried again. The loop stops after `rounds`, when `budget_hours`
of wall time have passed (checked between rounds: the round in flight finishes), or when proposals
run dry; it ends with the report of runner.loop_report.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import Callable

from kb.errors import InsufficientData, InvalidRecord
from runner.loop_report import BASELINE_TAG, START_TAG, write_loop_report
from runner.queue import FINISHED, listed

log = logging.getLogger(__name__)
AUTO_BY = "kb loop (auto)"
START_SEEDS = 2
SWEEP = (1 / 3, 3.0)          # the starting sweep's lr multiples around the baseline's
APPROVALS = ("auto", "manual")


def run_loop(kb, *, project: str | None = None, goal: str = "", rounds: int | None = None,
             budget_hours: float | None = None, approve: str = "auto", backend: str = "local",
             config: dict | None = None, n: int | None = None, budget_runs: int = 4, poll_s: float = 5.0,
             out: str | None = None, say: Callable[[str], None] | None = None):
    from runner.backends import check_backend

    say = say or (lambda text: log.info("%s", text))
    check_backend(backend)
    _check(rounds, budget_hours, approve, budget_runs, poll_s)
    if rounds is None and budget_hours is None:
        rounds = 3
    project = project or (config or {}).get("project") or "proxy"
    deadline = time.monotonic() + budget_hours * 3600 if budget_hours else math.inf
    n = n or (1 if approve == "auto" else 3)
    started = _start(kb, project, config, backend, say)
    done_rounds, stopped = [], f"{rounds} round(s) done" if rounds else "budget spent"
    round_no = 0
    while rounds is None or round_no < rounds:
        if time.monotonic() >= deadline:
            stopped = f"budget of {budget_hours:g} h spent"
            break
        round_no += 1
        try:
            proposals = kb.propose(goal=goal, n=n, project=project, budget_runs=budget_runs)
        except InsufficientData as exc:
            stopped = f"proposals ran dry: {exc}"
            say(f"round {round_no}: {stopped}")
            break
        chosen = _auto(kb, proposals) if approve == "auto" else _manual(kb, proposals, poll_s, deadline, say)
        if chosen is None:
            say(f"round {round_no}: no proposal approved")
            continue
        say(f"round {round_no}: {chosen['id']} {chosen['title']} ({chosen['change']})")
        result = _run(kb, chosen["id"], backend, {}, deadline)
        if result and result["outcome"] == "better" and not result["verified"]:
            second = _second_scale(kb, project, result)
            if second and time.monotonic() < deadline:
                say(f"round {round_no}: better at {result['effect']['params']:.3g} params; checking at {second:.3g}")
                result = _run(kb, chosen["id"], backend, {"scales": [second]}, deadline)
        done_rounds.append({"round": round_no, "hypothesis": chosen["id"], "result": result})
        say(f"round {round_no}: {_verdict_words(result)}")
    return write_loop_report(kb, project, goal=goal, rounds=done_rounds, stopped=stopped, approve=approve,
                             started_baseline=started, out=out)


def _check(rounds, budget_hours, approve, budget_runs, poll_s) -> None:
    if rounds is not None and (isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1):
        raise InvalidRecord(f"rounds must be a whole number of at least 1, not {rounds!r}", field="rounds")
    if budget_hours is not None and not (isinstance(budget_hours, (int, float)) and budget_hours > 0):
        raise InvalidRecord(f"the budget is a positive number of hours, not {budget_hours!r}", field="budget")
    if approve not in APPROVALS:
        raise InvalidRecord(f"approve must be one of {list(APPROVALS)}, not {approve!r}", field="approve")
    if isinstance(budget_runs, bool) or not isinstance(budget_runs, int) or budget_runs < 2:
        raise InvalidRecord(f"the run budget per hypothesis is at least 2, not {budget_runs!r}", field="budget_runs")
    if not (isinstance(poll_s, (int, float)) and poll_s > 0):
        raise InvalidRecord(f"the poll interval is a positive number of seconds, not {poll_s!r}", field="poll")


def _start(kb, project: str, config: dict | None, backend: str, say) -> bool:
    """The starting baseline and its sweep, when the project has no runs yet; True if started here."""
    from runner.scales import at_depth, spec_config, train_config
    from runner.submit import submit_config
    if kb.runs(project=project, limit=1):
        return False
    if config is None:
        raise InsufficientData(f"project {project!r} has no runs to start from: give a starting config "
                               "(kb loop --config FILE)")
    base = replace(train_config(config), project=project, name=None).resolved()
    cells = [(base, [START_TAG, BASELINE_TAG])]
    cells += [(replace(base, lr=base.lr * f, min_lr=base.min_lr * f), [START_TAG]) for f in SWEEP]
    cells.append((at_depth(base, base.n_layer + 1), [START_TAG]))
    say(f"project {project} has no runs: starting baseline {_describe(base)} with {START_SEEDS} seeds, "
        f"lr x{SWEEP[0]:.2g} and x{SWEEP[1]:g}, and depth {base.n_layer + 1}")
    for cfg, tags in cells:
        submit_config(kb, spec_config(cfg), backend=backend, project=project, seeds=START_SEEDS, tags=tags,
                      name=f"start-d{cfg.n_layer}-lr{cfg.lr:.3g}")
    kb.work(backend=backend, once=True)
    return True


def _describe(cfg) -> str:
    return f"n_layer {cfg.n_layer}, lr {cfg.lr:.3g}, {cfg.max_steps} steps"


def _auto(kb, proposals: list[dict]) -> dict | None:
    if not proposals:
        return None
    fitting = [h for h in proposals if (h.get("plan") or {}).get("fits_budget", True)]
    chosen = (fitting or proposals)[0]
    why = (f"auto: the top-ranked proposal{'' if fitting else ' (none fits the budget)'}, "
           f"source {chosen['source']}, predicted {chosen['predicted'].get('metric')} "
           f"{chosen['predicted'].get('delta', float('nan')):+.3g}")
    return kb.approve(chosen["id"], by=AUTO_BY, reason=why)


def _manual(kb, proposals: list[dict], poll_s: float, deadline: float, say) -> dict | None:
    """Wait for a person to approve one of the proposals (kb approve); None when all are rejected."""
    say("waiting for a decision: " + "; ".join(f"kb approve {h['id']}  ({h['title']})" for h in proposals))
    ids = [h["id"] for h in proposals]
    while time.monotonic() < deadline:
        now = {i: kb.hypothesis(i) for i in ids}
        approved = [h for h in now.values() if h["status"] == "approved"]
        if approved:
            return approved[0]
        if all(h["status"] == "rejected" for h in now.values()):
            return None
        time.sleep(poll_s)
    return None


def _run(kb, hypothesis: str, backend: str, options: dict, deadline: float) -> dict | None:
    """Queue the hypothesis (or its check at more scales), work until its jobs are done; its result."""
    from runner.submit import submit_hypothesis
    submit_hypothesis(kb, hypothesis, backend=backend, **options)
    while True:
        kb.work(backend=backend, once=True)
        if all(j["status"] in FINISHED for j in listed(kb.engine, hypothesis=hypothesis)):
            return kb.hypothesis(hypothesis)["result"]
        if time.monotonic() >= deadline:       # other workers hold its jobs; stop waiting for them
            for j in listed(kb.engine, hypothesis=hypothesis):
                if j["status"] not in FINISHED:
                    kb.cancel(j["id"])
        time.sleep(1.0)


def _second_scale(kb, project: str, result: dict) -> float | None:
    """The project's next larger scale than the one the gain was measured at."""
    here = result["effect"]["params"] if result.get("effect") else None
    if not here:
        return None
    larger = sorted({float(r.scale["params"]) for r in kb.runs(project=project)
                     if isinstance(r.scale.get("params"), (int, float)) and r.scale["params"] > here * 1.01})
    return larger[0] if larger else None


def _verdict_words(result: dict | None) -> str:
    if not result:
        return "no result"
    e = result.get("effect")
    if not e:
        return f"no verdict ({'; '.join(result.get('errors') or []) or 'no runs'})"
    low, high = e["interval"]
    return (f"{result['outcome']} at {e['params']:.3g} params: {result['metric']} {e['delta']:+.4f} "
            f"[{low:+.4f}, {high:+.4f}]" + ("; verified at a second scale" if result["verified"] else ""))
