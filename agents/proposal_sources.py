"""Candidate hypotheses from what the store already measured, besides the surrogate
(agents/surrogate.py):

- patterns: a change that ablations found better (kb.patterns: one ablation, or the same change
  in several projects) and that was never tried in another project or at a larger scale there;
- mixture: the best data mixture of a project that varies its mixture (kb.mixture);
- llm: a capable LLM's suggestions (KB_LLM_BACKEND openai or hf, or a GGUF of your choosing),
  over a digest of the runs, failures and ablations; the embedded 135M default is not asked.

Each returns agents.proposal.Candidate objects; agents/propose.py checks them all alike.
"""
from __future__ import annotations

import json
import logging
import math
from collections import defaultdict

from sqlalchemy import select

from agents.proposal import Candidate, History
from kb.ablations import MISSING
from kb.errors import InsufficientData, InvalidRecord, KBError, QueryError
from kb.fields import canonical, lookup
from kb.models import Ablation
from kb.vocab import canonical_hparams, metric_name

log = logging.getLogger(__name__)
LEVEL = 0.95
MAX_TARGETS = 3         # contexts one pattern is proposed into, largest scale first
MIX_DECIMALS = 3


# ---- patterns and ablations ---------------------------------------------------------------------

def pattern_candidates(kb, history: History, project: str | None = None) -> list[Candidate]:
    """A change that was better where it was ablated, proposed where it was never tried."""
    from kb.patterns import patterns
    with kb.engine.connect() as conn:
        factor_of = dict(conn.execute(select(Ablation.id, Ablation.factor)).all())
    contexts: dict[tuple, list] = defaultdict(list)       # (project, params) -> finished runs
    for r in history.runs:
        if history.value(r.id) is not None and not history.failed(r.id):
            contexts[(r.project, history.scale_of(r.id))].append(r)
    out = []
    for p in patterns(kb, level=LEVEL, min_instances=1):
        if (metric_name(p.metric) or p.metric) != history.metric or p.better_in <= p.worse_in:
            continue
        if MISSING in (p.baseline_level, p.level):
            continue                 # a key taken away is no value a change can set
        factor = factor_of.get(p.instances[0]["ablation"], "")
        tried = {(i["project"], i["params"]) for i in p.instances}
        largest = defaultdict(float)
        for proj, params in tried:
            largest[proj] = max(largest[proj], params or 0.0)
        targets = []
        for (proj, params), runs in contexts.items():
            if (project and proj != project) or (proj, params) in tried:
                continue
            if proj in largest and (params or 0.0) <= largest[proj]:
                continue             # a smaller scale of a project that tried it: nothing new
            changes = {r.id: ch for r in runs if (ch := _change_for(r.config, p, factor)) is not None}
            if any(_change_for(r.config, p, factor, applied=True) for r in runs) or not changes:
                continue             # already run there, or the factor is not set that way there
            base = history.best(changes)
            targets.append((params or 0.0, proj, base, changes[base]))
        for params, proj, base, change in sorted(targets, key=lambda t: (-t[0], t[1]))[:MAX_TARGETS]:
            c = _pattern_candidate(kb, history, p, proj, base, change)
            if c is not None:
                out.append(c)
    return out


def _change_for(config: dict, p, factor: str, applied: bool = False) -> dict | None:
    """The change that moves this config from the pattern's baseline level to its level (None when
    the config does not hold the baseline level); with `applied`, whether it holds the level already."""
    if isinstance(p.level, dict):           # a tag ablation: the keys its variant set
        try:
            from kb.hypotheses import split_key
            paths = {k: split_key(k) for k in p.level}
        except InvalidRecord:
            return None
        held = {k: lookup(config, path) for k, path in paths.items()}
        if applied:
            return all(found and v == p.level[k] for k, (found, v) in held.items()) or None
        if not all(found for found, _ in held.values()) or all(v == p.level[k] for k, (_, v) in held.items()):
            return None
        return dict(p.level)
    path = _leaf_named(config, p.factor, factor)
    if path is None:
        return None
    value = lookup(config, path)[1]
    if applied:
        return (value == p.level) or None
    return {canonical(path): p.level} if value == p.baseline_level else None


def _leaf_named(config: dict, name: str, factor: str) -> tuple[str, ...] | None:
    """The ablated key in this config: the factor's own path when the config has it, else the
    shallowest leaf whose last segment is the pattern's name (patterns match on it)."""
    if factor.startswith("config."):
        from kb.hypotheses import split_key
        try:
            path = split_key(factor[len("config."):])
        except InvalidRecord:
            path = None
        if path and lookup(config, path)[0]:
            return path
    frontier = [((), config)]
    while frontier:
        nxt = []
        for prefix, node in frontier:
            for k, v in node.items():
                if isinstance(v, dict):
                    nxt.append((prefix + (str(k),), v))
                elif str(k) == name:
                    return prefix + (str(k),)
        frontier = nxt
    return None


def _pattern_candidate(kb, history: History, p, project: str, base: str, change: dict) -> Candidate | None:
    from kb.noise import t_quantile
    n = p.of
    if n >= 2 and p.spread:
        # a new context is one more draw from the instances' spread: a prediction interval
        half = t_quantile(LEVEL, n - 1) * p.spread * math.sqrt(1 + 1 / n)
        interval = [p.effect - half, p.effect + half]
        method = (f"mean effect over {n} ablations, t prediction interval from their spread "
                  f"(transferred: not measured in project {project})")
    else:
        iv = p.instances[0]["interval"]
        if iv is None:
            return None             # no seed noise where it was measured: no claim to carry over
        interval = list(iv)
        method = (f"the effect measured in ablation {p.instances[0]['ablation']} with its seed-noise "
                  f"interval (transferred: not measured in project {project})")
    ablations = [i["ablation"] for i in p.instances]
    where = f"project {project}" + (f" at {s:.3g} params" if (s := history.scale_of(base)) else "")
    moves = ", ".join(f"{k} -> {v!r}" for k, v in change.items())
    rationale = (f"{p.factor} {_show(p.baseline_level)} -> {_show(p.level)} was {p.record} on {p.metric} "
                 f"({', '.join(ablations)}), and was never tried in {where}; its best run there, {base} "
                 f"({history.value(base):.4g}), still has {_show(p.baseline_level)}.")
    return Candidate(
        source="pattern" if n >= 2 else "ablation", project=project, baseline=base, change=change,
        title=f"{moves} in {where} (better in {p.better_in} of {n} ablations)", rationale=rationale,
        evidence=[base] + list(dict.fromkeys(p.evidence)),
        predicted={"metric": history.metric, "delta": p.effect, "interval": interval, "level": LEVEL,
                   "higher_is_better": history.higher, "baseline_value": history.value(base), "method": method})


def _show(v) -> str:
    return json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else f"{v}"


# ---- data mixture -------------------------------------------------------------------------------

def mixture_candidates(kb, history: History, project: str | None = None) -> list[Candidate]:
    """The predicted best mixture of each project whose runs vary their data mixture."""
    from kb.mixture import fit_mixture, mixture_of
    projects = set()
    for r in history.runs:
        if project and r.project != project:
            continue
        try:
            if mixture_of(r):
                projects.add(r.project)
        except InvalidRecord as exc:
            log.info("mixture: %s", exc)
    out = []
    for proj in sorted(projects):
        try:
            fit = fit_mixture(kb, project=proj, metric=history.metric)
            weights, predicted, (low, high) = fit.best()
        except (InsufficientData, InvalidRecord, QueryError) as exc:
            log.info("no mixture fit for project %s: %s", proj, exc)
            continue
        base_id = history.best(fit.runs)
        if base_id is None:
            continue
        base = history.by_id[base_id]
        base_mix = {s: w for s, w in mixture_of(base).items() if s in fit.sources}
        base_pred = fit.predict({s: base_mix.get(s, 0.0) for s in fit.sources})
        change = _mixture_change(base.config, weights, base_mix)
        if not change:
            continue
        shown = ", ".join(f"{s} {base_mix.get(s, 0):.2f} -> {w:.{MIX_DECIMALS}f}" for s, w in sorted(weights.items()))
        out.append(Candidate(
            source="mixture", project=proj, baseline=base_id, change=change,
            title=f"data mixture {shown} in project {proj}",
            rationale=(f"A {fit.form} mixture law fitted to {len(fit.runs)} runs of project {proj} (cross-validated "
                       f"R² {fit.cv_r2:.2f}) predicts {history.metric} {predicted:.4g} at this mixture, against "
                       f"{base_pred:.4g} at the mixture of its best run, {base_id}."),
            evidence=[base_id] + [r for r in fit.runs if r != base_id],
            predicted={"metric": history.metric, "delta": predicted - base_pred,
                       "interval": [min(low, predicted) - base_pred, max(high, predicted) - base_pred],
                       "level": fit.level, "higher_is_better": history.higher,
                       "baseline_value": history.value(base_id),
                       "method": f"{fit.form} mixture law; bootstrap interval ({fit.samples} refits) of the "
                                 f"prediction at the mixture, less the fit at the baseline's mixture"}))
    return out


def _mixture_change(config: dict, weights: dict[str, float], base_mix: dict[str, float]) -> dict:
    """Rounded weights that still sum to 1 (the largest takes the rounding), as change keys spelled
    the way the baseline's config spells its mixture (nested or flat)."""
    rounded = {s: round(w, MIX_DECIMALS) for s, w in weights.items()}
    top = max(rounded, key=rounded.get)
    rounded[top] = round(1 - math.fsum(w for s, w in rounded.items() if s != top), MIX_DECIMALS)
    change = {}
    for s, w in rounded.items():
        if abs(w - base_mix.get(s, 0.0)) < 10 ** -MIX_DECIMALS:
            continue
        nested, flat = ("data", "mixture", s), (f"data.mixture.{s}",)
        path = next((p for p in (nested, flat) if lookup(config, p)[0]), nested)
        change[canonical(path)] = w
    return change


# ---- a capable LLM ------------------------------------------------------------------------------

SCHEMA = {
    "type": "object", "required": ["hypotheses"],
    "properties": {"hypotheses": {"type": "array", "maxItems": 5, "items": {
        "type": "object",
        "required": ["title", "rationale", "baseline_run", "change", "evidence", "delta", "low", "high"],
        "properties": {"title": {"type": "string", "maxLength": 200},
                       "rationale": {"type": "string", "maxLength": 1200},
                       "baseline_run": {"type": "string"},
                       "change": {"type": "object"},
                       "evidence": {"type": "array", "items": {"type": "string"}},
                       "delta": {"type": "number"}, "low": {"type": "number"}, "high": {"type": "number"}}}}},
}
DIGEST_RUNS = 8         # best finished runs per project shown to the LLM
DIGEST_LINES = 40       # failed runs, and ablations, shown at most


def llm_is_capable(settings) -> bool:
    """Asked only when someone configured a model: an endpoint, a Hugging Face model, or a GGUF."""
    return settings.llm_backend != "llamacpp" or bool(settings.llm_model)


def llm_candidates(kb, history: History, goal: str, n: int, project: str | None = None) -> list[Candidate]:
    if not llm_is_capable(kb.settings):
        return []
    from agents.llm import complete_json, get_llm
    messages = [{"role": "system", "content": (
        "You propose the next pretraining experiments. Each hypothesis changes one baseline run's config "
        "(keys are dotted paths of that run's config), cites as evidence only run and ablation ids listed "
        "in the sources, and predicts the change in the metric (delta, with a low-high interval).")},
        {"role": "user", "content": f"Goal: {goal or 'improve ' + history.metric}\nMetric: {history.metric} "
                                    f"({'higher' if history.higher else 'lower'} is better)\nPropose up to {n}.\n\n"
                                    f"<sources>\n{_digest(kb, history, project)}\n</sources>"}]
    try:
        answer = complete_json(get_llm(kb.settings), messages, SCHEMA)
    except KBError as exc:
        log.warning("the LLM's suggestions were not used: %s", exc)
        return []
    out = []
    for h in answer["hypotheses"]:
        base = history.by_id.get(h["baseline_run"])
        out.append(Candidate(
            source="llm", project=base.project if base else "", baseline=h["baseline_run"], change=h["change"],
            title=h["title"], rationale=h["rationale"], evidence=list(dict.fromkeys(h["evidence"])),
            predicted={"metric": history.metric, "delta": h["delta"], "interval": [h["low"], h["high"]],
                       "level": None, "higher_is_better": history.higher,
                       "baseline_value": history.value(base.id) if base else None,
                       "method": "the LLM's estimate (not fitted to the runs)"}))
    return out


def _digest(kb, history: History, project: str | None) -> str:
    """Runs, failures and ablations in a few lines each: what the LLM may cite."""
    lines = []
    by_project: dict[str, list] = defaultdict(list)
    for r in history.runs:
        if not project or r.project == project:
            by_project[r.project].append(r)
    for proj, runs in sorted(by_project.items()):
        finished = sorted((r for r in runs if history.value(r.id) is not None),
                          key=lambda r: (-history.value(r.id) if history.higher else history.value(r.id)))
        for r in finished[:DIGEST_RUNS]:
            hp = {k: v for k, (_, v) in canonical_hparams(r.config).items()}
            lines.append(f"run {r.id} project={proj} params={r.scale.get('params')} {history.metric}="
                         f"{history.value(r.id):.4g} config={json.dumps(r.config, sort_keys=True)[:400]} hparams={hp}")
    failed = [r for proj in sorted(by_project) for r in by_project[proj] if history.failed(r.id)]
    for r in failed[:DIGEST_LINES]:
        hp = {k: v for k, (_, v) in canonical_hparams(r.config).items()}
        lines.append(f"run {r.id} project={r.project} FAILED {history.failed(r.id)} hparams={hp}")
    stmt = select(Ablation.id, Ablation.project, Ablation.factor, Ablation.variants).order_by(Ablation.id)
    if project:
        stmt = stmt.where(Ablation.project == project)
    with kb.engine.connect() as conn:
        rows = conn.execute(stmt.limit(DIGEST_LINES)).all()
    for aid, proj, factor, variants in rows:
        shown = "; ".join(f"{_show(v['value'])}: delta {v['delta']:+.4g}" for v in variants
                          if v.get("delta") is not None and not v["baseline"])
        lines.append(f"ablation {aid} project={proj} factor={factor} {shown}")
    return "\n".join(lines)
