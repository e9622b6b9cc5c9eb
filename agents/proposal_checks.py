"""What every candidate hypothesis must pass before it is stored, the risks past failures put on it,
and the validation plan that would settle it within a budget.

Checks (`problems`): the baseline run exists; each change key is a key of the baseline's config
or an option the runner accepts (runner.options), and sets a new, finite value; every evidence id
names a run or ablation in the store; the predicted effect is finite, with an interval around it.

Risks (`risks`): the runs that diverged or ran out of memory in the same project, or at a larger
scale anywhere, are read against the change. One that failed with a value the change sets (a
norm, an optimizer: any value that is not a number) is a risk. A change that raises the learning
rate, batch size or sequence length is read against the runs that diverged (lr) or ran out of
memory (batch, sequence): a failing value at most RISK_FACTOR times the proposed one is a risk.
Each is cited by run id. The stability edge moves with scale, batch size and warmup by about that
factor (muP-style width scaling shifts the best lr by the width ratio), so a rate 4x below one
that diverged is not yet safe.

Plan (`plan`): seeds enough to resolve the predicted effect against the seed noise (a two-sample
test at 5% with 80% power: n = 2((z_.975 + z_.8) sd / |delta|)^2 per side, at least 2, at most
MAX_SEEDS), at the baseline's scale and steps, plus any larger scale the source asks for; cut
to the budget (runs, and FLOPs when given) by dropping larger scales first, then seeds.
"""
from __future__ import annotations

import math

from sqlalchemy import select

from agents.proposal import Candidate, History
from kb.errors import InvalidRecord
from kb.fields import lookup
from kb.hypotheses import split_key
from kb.models import Ablation
from kb.vocab import canonical_hparams
from runner.options import is_runner_option

RISK_FACTOR = 4.0
RISKY_KEYS = {"diverged": ("lr",), "oom": ("batch_size", "micro_batch_size", "seq_len")}
MIN_SEEDS, MAX_SEEDS, DEFAULT_SEEDS = 2, 8, 3
Z_TEST = 1.959964 + 0.841621        # two-sided 5% plus 80% power
DEFAULT_BUDGET_RUNS = 8


# ---- checks -------------------------------------------------------------------------------------

def ablation_ids(engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(select(Ablation.id)).scalars())


def problems(c: Candidate, history: History, ablations: set[str]) -> list[str]:
    """What is wrong with a candidate, in words; empty when it may be stored."""
    out = []
    base = history.by_id.get(c.baseline)
    if base is None:
        return [f"baseline run {c.baseline!r} does not exist"]
    if not isinstance(c.change, dict) or not c.change:
        out.append("the change is empty")
    for key, value in (c.change or {}).items():
        try:
            path = split_key(key)
        except InvalidRecord as exc:
            out.append(exc.error)
            continue
        found, old = lookup(base.config, path)
        if not found and not is_runner_option(key):
            out.append(f"change key {key!r} is neither in {base.id}'s config nor an option the runner accepts")
        if not _is_value(value):
            out.append(f"change {key!r}: {value!r} is not a finite number, string or boolean")
        elif found and old == value:
            out.append(f"change {key!r}: {base.id} already has {value!r}")
    missing = [e for e in c.evidence if e not in history.by_id and e not in ablations]
    if not c.evidence:
        out.append("no evidence")
    if missing:
        out.append(f"evidence names no run or ablation: {', '.join(map(str, missing))}")
    p = c.predicted
    delta, interval = p.get("delta"), p.get("interval")
    if not p.get("metric"):
        out.append("the prediction names no metric")
    if not _finite(delta) or not (isinstance(interval, (list, tuple)) and len(interval) == 2
                                  and all(_finite(x) for x in interval)):
        out.append(f"the predicted effect is not a finite delta with an interval: {delta!r}, {interval!r}")
    elif not interval[0] <= delta <= interval[1]:
        out.append(f"the predicted delta {delta:g} lies outside its interval {interval}")
    return out


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_value(v) -> bool:
    return isinstance(v, (str, bool)) or _finite(v)


# ---- risks --------------------------------------------------------------------------------------

def risks(c: Candidate, history: History, resolved: dict) -> list[str]:
    """Past failures that a change moving towards them runs into, each citing its run."""
    base = history.by_id[c.baseline]
    before = {k: v for k, (_, v) in canonical_hparams(base.config).items()}
    after = {k: v for k, (_, v) in canonical_hparams(resolved).items()}
    scale = history.scale_of(c.baseline) or 0.0
    paths = {}
    for key, value in c.change.items():
        try:
            paths[key] = (split_key(key), value)
        except InvalidRecord:
            continue
    out = []
    for run in history.runs:
        kind = history.failed(run.id)
        if kind is None or run.id == c.baseline:
            continue
        their_scale = history.scale_of(run.id)
        if run.project != c.project and not (their_scale and their_scale > scale):
            continue
        for key, (path, value) in paths.items():
            if not _finite(value) and lookup(run.config, path) == (True, value):
                out.append(_same_value_text(run, kind, key, value, history))
        theirs = {k: v for k, (_, v) in canonical_hparams(run.config).items()}
        for key in RISKY_KEYS.get(kind, ()):
            new, old, bad = after.get(key), before.get(key), theirs.get(key)
            if not (_finite(new) and _finite(bad) and new > 0 and bad > 0) or (_finite(old) and new <= old):
                continue                      # the change does not raise this key
            if bad <= RISK_FACTOR * new:
                out.append(_risk_text(run, kind, key, new, bad, history))
    return out


def _failure_words(run, kind: str, history: History) -> tuple[str, str, str]:
    what = "diverged" if kind == "diverged" else "ran out of memory"
    where = f"project {run.project}" + (f", {s:.3g} params" if (s := history.scale_of(run.id)) else "")
    step = next((f["step"] for f in history.failures.get(run.id, ()) if f["kind"] == kind and f["step"] is not None),
                None)
    return what, where, f" at step {step}" if step is not None else ""


def _same_value_text(run, kind: str, key: str, value, history: History) -> str:
    what, where, at = _failure_words(run, kind, history)
    return f"{key} {value!r}: {run.id} {what}{at} with the same {key} ({where}) [{run.id}]"


def _risk_text(run, kind: str, key: str, new: float, bad: float, history: History) -> str:
    what, where, at = _failure_words(run, kind, history)
    relation = "at or below" if bad <= new else f"within {RISK_FACTOR:g}x of"
    return (f"{key} {new:g}: {run.id} {what}{at} with {key} {bad:g} ({where}), {relation} the proposed value "
            f"[{run.id}]")


# ---- the validation plan ------------------------------------------------------------------------

def plan(c: Candidate, history: History, budget_runs: int = DEFAULT_BUDGET_RUNS,
         budget_flops: float | None = None) -> dict:
    """Scales, seeds and steps that would settle the candidate, sized to the budget."""
    base = history.by_id[c.baseline]
    steps = max((s.get("last_step") or 0 for s in base.stats.values() if isinstance(s, dict)), default=0) or None
    delta, sd = abs(c.predicted["delta"]), c.noise_sd
    if sd and delta > 0:
        seeds = min(MAX_SEEDS, max(MIN_SEEDS, math.ceil(2 * (Z_TEST * sd / delta) ** 2)))
        why = f"{seeds} seeds per side resolve a {delta:.3g} effect against seed noise {sd:.3g} (5%, 80% power)"
    else:
        seeds, why = DEFAULT_SEEDS, f"no seed noise measured for this config: {DEFAULT_SEEDS} seeds per side"
    scales = [history.scale_of(c.baseline)] + [s for s in c.scales if s]
    flops = _flops_per_run(base)
    ratio = lambda s: (s / scales[0]) ** 2 if s and scales[0] else 1.0     # noqa: E731  (N and D grow together)

    def cost(n_scales: int, n_seeds: int) -> tuple[int, float | None]:
        runs = n_seeds * n_scales
        total = None if flops is None else sum(flops * ratio(s) * n_seeds for s in scales[:n_scales])
        return runs, total

    n_scales, fits = len(scales), True
    while True:
        runs, total = cost(n_scales, seeds)
        if runs <= budget_runs and (budget_flops is None or total is None or total <= budget_flops):
            break
        if n_scales > 1:
            n_scales -= 1
            why += "; a larger scale dropped to fit the budget"
        elif seeds > MIN_SEEDS:
            seeds -= 1
            why += f"; cut to {seeds} seeds to fit the budget"
        else:
            fits = False
            why += "; over budget even at one scale and two seeds"
            break
    return {"scales": [{"params": s} for s in scales[:n_scales]], "seeds": seeds, "steps": steps,
            "runs": runs, "flops": total, "budget": {"runs": budget_runs, "flops": budget_flops},
            "fits_budget": fits, "why": why}


def _flops_per_run(run) -> float | None:
    flops = run.scale.get("flops")
    if _finite(flops):
        return float(flops)
    n, d = run.scale.get("params"), run.scale.get("tokens")
    return 6.0 * n * d if _finite(n) and _finite(d) else None
