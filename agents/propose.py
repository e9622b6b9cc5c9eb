"""The proposer: grounded hypotheses for the next experiments, stored with status `proposed`.

    kb propose --goal "lower val/loss" -n 3 --project gpt-sweep
    hs = k.propose(goal="lower val/loss", n=3)      # -> list of Hypothesis dicts (SPEC shape)

Stages:
    1. history     every run with its final metric (the goal's, val/loss by default) and failures
    2. candidates  from the surrogate (agents/surrogate.py), ablation patterns, the data-mixture
                   fit and, when one is configured, a capable LLM (agents/proposal_sources.py)
    3. checks      baseline exists, keys exist or the runner takes them, evidence exists, a
                   finite prediction with its interval (agents/proposal_checks.py)
    4. dedupe      the resolved config (baseline + change, seeds aside) must be new to the store:
                   no run and no hypothesis holds it (kb.hypotheses.held_by), nor an earlier pick
    5. risks, plan failures the change moves towards, cited; seeds (enough for the predicted
                   effect against seed noise) at the baseline's scale and the project's next
                   larger one, and steps, cut to the budget
    6. store       the picks, best predicted gain first within each source, sources taking turns
"""
from __future__ import annotations

import logging
from collections import defaultdict

from agents.proposal import Candidate, History
from agents.proposal_checks import DEFAULT_BUDGET_RUNS, ablation_ids, plan, problems, risks
from agents.proposal_sources import llm_candidates, mixture_candidates, pattern_candidates
from agents.surrogate import surrogate_candidates
from kb.errors import InsufficientData, InvalidRecord, KBError, NotFound
from kb.hypotheses import apply_change, config_key, held_by, hypothesis_id, store

log = logging.getLogger(__name__)
MAX_N = 50


def propose(kb, goal: str = "", n: int = 3, project: str | None = None, metric: str | None = None,
            budget_runs: int = DEFAULT_BUDGET_RUNS, budget_flops: float | None = None) -> list[dict]:
    """Up to n new hypotheses, stored as `proposed`; InsufficientData when the store supports none."""
    _check_arguments(n, budget_runs, budget_flops)
    if project and not kb.runs(project=project, limit=1):
        raise NotFound(f"no runs in project {project!r}")
    history = History.load(kb, goal, metric)
    if not history.runs:
        raise InsufficientData("the knowledge base holds no runs to propose from; kb ingest some first")

    picked: set[tuple[str, str]] = set()

    def is_new(proj: str, config: dict) -> bool:
        return (proj, config_key(proj, config)) not in picked and not held_by(kb.engine, proj, config)

    candidates = _gather(kb, history, goal, n, project, is_new)
    known_ablations = ablation_ids(kb.engine)
    rows, dropped = [], defaultdict(int)
    for c in _in_turns(candidates):
        if len(rows) >= n:
            break
        wrong = problems(c, history, known_ablations)
        if wrong:
            log.info("%s candidate %r dropped: %s", c.source, c.title, "; ".join(wrong))
            dropped["invalid"] += 1
            continue
        resolved = apply_change(history.by_id[c.baseline].config, c.change)
        if not is_new(c.project, resolved):
            dropped["already held"] += 1
            continue
        key = config_key(c.project, resolved)
        picked.add((c.project, key))
        if c.noise_sd is None:
            c.noise_sd = _seed_sd(kb, c.project, history.metric)
        if not c.scales:
            c.scales = _next_scale(history, c)
        rows.append(_row(c, history, goal, key, resolved, budget_runs, budget_flops))
    if not rows:
        why = ", ".join(f"{k}: {v}" for k, v in dropped.items()) or "no source had a candidate"
        raise InsufficientData(
            f"nothing new to propose{' in project ' + repr(project) if project else ''} ({why}). A proposal needs "
            f"runs of one project and scale that vary a numeric key (keys + 3 finished runs), an ablation with a "
            f"clear gain not yet tried elsewhere, or runs that vary their data mixture")
    return store(kb.engine, rows)


def _seed_sd(kb, project: str, metric: str) -> float | None:
    from kb.noise import seed_noise
    try:
        return seed_noise(kb, project, metric).sd
    except InsufficientData:
        return None


def _next_scale(history: History, c: Candidate) -> list[float]:
    """The project's next larger scale, where the plan checks that the gain transfers (the plan
    drops it first when the budget is short)."""
    here = history.scale_of(c.baseline)
    larger = sorted({s for r in history.runs if r.project == c.project and (s := history.scale_of(r.id))
                     and here and s > here})
    return larger[:1]


def _check_arguments(n, budget_runs, budget_flops) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise InvalidRecord(f"n must be an integer from 1 to {MAX_N}, not {n!r}", field="n")
    if isinstance(budget_runs, bool) or not isinstance(budget_runs, int) or budget_runs < 2:
        raise InvalidRecord(f"the run budget must be an integer of at least 2 (one run per side), not {budget_runs!r}",
                            field="budget_runs")
    if budget_flops is not None and not (isinstance(budget_flops, (int, float)) and budget_flops > 0):
        raise InvalidRecord(f"the FLOP budget must be a positive number, not {budget_flops!r}", field="budget_flops")


def _gather(kb, history: History, goal: str, n: int, project: str | None, is_new) -> list[Candidate]:
    """Every source's candidates; a source that cannot run here says why in the log and adds none."""
    sources = {
        "surrogate": lambda: surrogate_candidates(history, n, is_new, project),
        "pattern": lambda: pattern_candidates(kb, history, project),
        "mixture": lambda: mixture_candidates(kb, history, project),
        "llm": lambda: llm_candidates(kb, history, goal, n, project),
    }
    out = []
    for name, source in sources.items():
        try:
            found = source()
        except KBError as exc:
            log.info("proposal source %s: %s", name, exc)
            continue
        out += [c for c in found if not project or c.project == project]
    return out


def _in_turns(candidates: list[Candidate]) -> list[Candidate]:
    """Best predicted gain first within each source; sources take turns, the one with the best
    candidate first, so n proposals are not all one kind."""
    by_source: dict[str, list[Candidate]] = defaultdict(list)
    for c in candidates:
        by_source[c.source].append(c)
    queues = sorted((sorted(cs, key=lambda c: -c.gain) for cs in by_source.values()), key=lambda q: -q[0].gain)
    out = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


def _row(c: Candidate, history: History, goal: str, key: str, resolved: dict, budget_runs: int,
         budget_flops: float | None) -> dict:
    predicted = {k: v for k, v in c.predicted.items() if v is not None}
    return dict(id=hypothesis_id(c.project, key), title=c.title, rationale=c.rationale, baseline_run=c.baseline,
                change=c.change, evidence=list(dict.fromkeys(c.evidence)), predicted=predicted,
                risks=risks(c, history, resolved), status="proposed", result=None, project=c.project,
                source=c.source, goal=goal or None, config_hash=key,
                plan=plan(c, history, budget_runs=budget_runs, budget_flops=budget_flops))
