"""The stages of `kb demo`, over the Python API: load the demo history, index it, propose
hypotheses over it, and run one approved hypothesis's jobs inline, each saying what it does.

    steps = Stages(k, say=print)
    folder = steps.history(fresh=False)       # the home's regenerated history, else the package's
    report = steps.load(folder)               # ingested by content hash: a second load adds nothing
    steps.index(); hs = steps.propose(); h = steps.run_one(hs)

The history is the one runner.demo_history trains (kb/demo_history in the package; `--fresh`
trains it again into <home>/demo_history, KB_DEMO_STEPS steps a run). Proposals are made once
per home: a demo project that has hypotheses already gets none new, and a hypothesis the demo
approved and ran is not run again (one left unfinished, say by a Ctrl-C, is finished).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

SHIPPED = Path(__file__).resolve().parent.parent / "demo_history"
PROJECT, MIX_PROJECT = "demo-gpt", "demo-mix"
STEPS_ENV = "KB_DEMO_STEPS"          # runner.demo_history's steps for --fresh (tests train a few)
GOAL = "lower val/loss"
DECIDED_BY = "kb demo"


def history_files(folder: Path) -> list[Path]:
    return [folder / "runs.jsonl", *sorted((folder / "notes").glob("*.md"))]


class Stages:
    def __init__(self, kb, say: Callable[[str], None]):
        self.kb = kb
        self._say = say
        self.started = time.perf_counter()
        self.timings: dict[str, float] = {}

    def say(self, text: str) -> None:
        self._say(f"[{time.perf_counter() - self.started:5.1f} s] {text}")

    def _timed(self, stage: str, t0: float) -> float:
        self.timings[stage] = round(time.perf_counter() - t0, 2)
        return self.timings[stage]

    # ---- the history --------------------------------------------------------------------------

    def history(self, fresh: bool = False) -> Path:
        """The folder to load: trained now (fresh) into the home, the home's earlier fresh one, or
        the package's."""
        home = Path(self.kb.settings.home) / "demo_history"
        if not fresh:
            if (home / "runs.jsonl").exists():
                self.say(f"using the history regenerated earlier in {home} (kb demo --fresh trains it again)")
                return home
            return SHIPPED
        from runner.demo_history import STEPS, generate
        steps = _steps_from_env(STEPS)
        t0 = time.perf_counter()
        self.say(f"training the demo history with the proxy trainer into {home} ({steps} steps a run)")
        generate(home, steps=steps, say=self.say)
        self.say(f"trained in {self._timed('train', t0):.1f} s")
        return home

    def load(self, folder: Path):
        files = history_files(folder)
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            from kb.errors import KBError
            raise KBError(f"the demo history is incomplete: {', '.join(missing)} missing; kb demo --fresh trains it again")
        t0 = time.perf_counter()
        what = "the package's" if folder == SHIPPED else "the"
        self.say(f"loading {what} demo history: {folder / 'runs.jsonl'} and {len(files) - 1} notes")
        report = self.kb.ingest(*map(str, files), index=False)
        self.say(f"loaded in {self._timed('load', t0):.1f} s: added {report.added}, updated {report.updated}, "
                 f"unchanged {report.unchanged}" + (f", failed {len(report.failed)}" if report.failed else ""))
        return report

    def index(self) -> int:
        """Embed what the load queued (runs' cards, note chunks, ablations, failures)."""
        pending = self.kb.pending_index()
        t0 = time.perf_counter()
        if pending:
            self.say(f"indexing {pending} records for search (loading the embedding model) ...")
        self.kb.sync_index()
        if pending:
            self.say(f"indexed in {self._timed('index', t0):.1f} s")
        return pending

    # ---- hypotheses and a job ------------------------------------------------------------------

    def propose(self, n: int = 3) -> list[dict]:
        """The demo project's hypotheses: proposed now when it has none yet (KnowledgeBase.propose,
        no LLM: the surrogate, ablation patterns and mixture fits)."""
        from kb.errors import InsufficientData
        held = self.kb.hypotheses(project=PROJECT)
        if held:
            self.say(f"{len(held)} hypotheses of {PROJECT} are stored already: none proposed again")
            return held
        t0 = time.perf_counter()
        self.say(f"proposing {n} hypotheses over {PROJECT} (goal: {GOAL}) ...")
        try:
            made = self.kb.propose(goal=GOAL, n=n, project=PROJECT)
        except InsufficientData as exc:
            self.say(f"no hypotheses: {exc}")
            return []
        self.say(f"proposed {len(made)} in {self._timed('propose', t0):.1f} s: "
                 + "; ".join(f"{h['id']} {h['title']}" for h in made))
        return made

    def run_one(self, hypotheses: list[dict]) -> dict | None:
        """Approve the proposal that is cheapest to settle (fewest planned runs, then the largest
        predicted gain) and run its jobs inline, here; a hypothesis the demo approved before is
        finished instead, or left as it is when done. The hypothesis as it ends."""
        ours = [h for h in hypotheses if (h.get("decision") or {}).get("by") == DECIDED_BY]
        if ours:
            h = self.kb.hypothesis(ours[0]["id"])
            if h["status"] == "done":
                self.say(f"{h['id']} ran in an earlier kb demo: {_verdict(h)}")
                return h
        else:
            proposed = [h for h in hypotheses if h["status"] == "proposed"]
            if not proposed:
                return None
            pick = min(proposed, key=lambda h: ((h.get("plan") or {}).get("runs") or 99,
                                                -abs((h.get("predicted") or {}).get("delta") or 0)))
            h = self.kb.approve(pick["id"], by=DECIDED_BY,
                                reason="the proposal cheapest to settle, run by the demo so the Jobs tab has a verdict")
            self.say(f"approved {h['id']}: {h['title']}")
        return self._run(h)

    def _run(self, h: dict) -> dict:
        import torch
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        if h["status"] == "approved":
            jobs = self.kb.submit(h["id"], backend="inline")
            fresh = [j for j in jobs if j["status"] not in ("succeeded",)]
            self.say(f"queued {len(jobs)} jobs of {h['id']} ({len(jobs) - len(fresh)} answered by runs the store "
                     f"holds); training {len(fresh)} inline ...")

        seen: set[str] = set()

        def progress(job_id: str, at: dict) -> None:
            if job_id not in seen:           # once a job, at its first evaluation
                seen.add(job_id)
                self.say(f"training {job_id} ({self.kb.job(job_id)['name']}) ...")

        self.kb.work(backend="inline", once=True, on_progress=progress)
        for job in self.kb.jobs(hypothesis=h["id"]):
            held = job["status"] == "succeeded" and not job["attempts"]      # answered by a run the store had
            self.say(f"job {job['id']} {job['name']}: {job['status']}, run {job['run'] or '-'}"
                     + (" (held already)" if held else ""))
        h = self.kb.hypothesis(h["id"])
        self.say(f"{h['id']} {h['status']} in {self._timed('jobs', t0):.1f} s: {_verdict(h)}")
        return h


def _verdict(h: dict) -> str:
    result = h.get("result") or {}
    effect = result.get("effect")
    if not effect:
        return "no verdict yet" if h["status"] != "done" else "no verdict (" + "; ".join(result.get("errors") or []) + ")"
    low, high = effect["interval"]
    return (f"{result['outcome']}: {result['metric']} {effect['delta']:+.3f} [{low:+.3f}, {high:+.3f}] "
            f"at {effect['params']:.3g} params")


def _steps_from_env(default: int) -> int:
    from kb.errors import InvalidRecord
    text = os.environ.get(STEPS_ENV)
    if not text:
        return default
    try:
        steps = int(text)
    except ValueError:
        steps = 0
    if steps < 1:
        raise InvalidRecord(f"{STEPS_ENV}={text!r} is not a whole number of steps >= 1", field=STEPS_ENV)
    return steps
