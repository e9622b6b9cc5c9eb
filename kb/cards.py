"""A run as a short, deterministic text: what gets embedded, and what an LLM reads as context.

Same run, same card, byte for byte: the card's hash tells the indexer whether the
vector is stale.
"""
from __future__ import annotations

import hashlib
from typing import Any

from kb.fields import leaves
from kb.vocab import canonical_hparams, canonical_metrics

CARD_CONFIG_KEYS = 14      # a card is ~100 tokens: enough to tell runs apart, cheap to embed


def human(n: float | int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}" if isinstance(n, float) else str(n)


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def run_card(run: dict, failures: list[dict], anomalies: list[dict], hp: dict | None = None) -> str:
    """`run` holds the row's fields (id, name, project, status, config, scale, summary, tags, notes);
    `hp` its config's canonical_hparams where the caller has them."""
    lines = [f"run {run['name'] or run['id']} (id {run['id']}) in project {run['project']}; status {run['status']}"]
    hp = canonical_hparams(run["config"]) if hp is None else hp
    if hp:     # the vocabulary's names first, so cards from different sources read alike
        lines.append("hyperparameters: " + " ".join(f"{name}={fmt(v)}" for name, (_, v) in hp.items()))
    cfg = [f"{'.'.join(p)}={fmt(v)}" for p, v in leaves(run["config"]) if p and not isinstance(v, (dict, list))]
    if cfg:
        more = f" (+{len(cfg) - CARD_CONFIG_KEYS} more)" if len(cfg) > CARD_CONFIG_KEYS else ""
        lines.append("config: " + " ".join(cfg[:CARD_CONFIG_KEYS]) + more)
    scale = run["scale"]
    if any(scale.get(k) is not None for k in ("params", "tokens", "flops")):
        lines.append(f"scale: {human(scale.get('params'))} params, {human(scale.get('tokens'))} tokens, "
                     f"{fmt(scale['flops']) if scale.get('flops') else '?'} FLOPs")
    named = {key: canon for canon, key in canonical_metrics(run["summary"]).items()}
    finals = [f"{named.get(k, k)}={fmt(v)}" + (f" ({k})" if named.get(k, k) != k else "")
              for k, v in sorted(run["summary"].items(), key=lambda kv: (kv[0] not in named, kv[0]))
              if not isinstance(v, (dict, list))]
    if finals:
        lines.append("final: " + " ".join(finals[:8]))
    for f in failures[:3]:
        at = f" at step {f['step']}" if f.get("step") is not None else ""
        lines.append(f"failure: {f['kind']}{at}: {f.get('message', '')[:160]}")
    for a in anomalies[:3]:
        lines.append(f"anomaly: {a['kind']} in {a['key']} at step {a['step']}")
    if run["tags"]:
        lines.append("tags: " + ", ".join(run["tags"]))
    if run.get("notes"):
        lines.append("notes: " + " ".join(run["notes"].split())[:300])
    return "\n".join(lines)


def card_hash(card: str) -> str:
    return hashlib.sha1(card.encode()).hexdigest()[:16]


def ablation_card(ablation: dict, labels: dict[str, str] | None = None) -> str:
    """An ablation as text: the factor, the metric, each variant's value and final metric, and
    whether the effect clears the seed noise. `labels` maps run ids to names where known."""
    labels = labels or {}
    effect = ablation.get("effect") or {}
    lines = [f"ablation {ablation['id']} in project {ablation['project']}: "
             f"{ablation['factor']} varied, {ablation.get('metric') or 'no metric'} compared"]
    for v in ablation.get("variants") or []:
        run = v.get("run") or (v.get("runs") or ["?"])[0]
        metric = "no final value" if v.get("metric") is None else fmt(v["metric"])
        delta = "" if v.get("delta") is None or v.get("baseline") else f" (delta {v['delta']:+.4g})"
        role = " baseline" if v.get("baseline") else ""
        seeds = f", {v['seeds']} seeds" if (v.get("seeds") or 1) > 1 else ""
        lines.append(f"{ablation['factor']}={fmt(v.get('value'))}{role}: {metric}{delta} "
                     f"(run {labels.get(run, run)}{seeds})")
    if effect.get("best"):
        lines.append(f"best: run {labels.get(effect['best'], effect['best'])}")
    if effect.get("seed_sigma") is not None:
        lines.append(f"seed noise sigma {fmt(effect['seed_sigma'])}")
    return "\n".join(lines)


def failure_card(failure: dict, run: dict) -> str:
    """A failure as text, with the run it ended and that run's main hyperparameters, so a
    question like "why did the 350M run at lr 3e-3 diverge" finds it."""
    at = f" at step {failure['step']}" if failure.get("step") is not None else ""
    hp = canonical_hparams(run.get("config") or {})
    lines = [f"failure {failure['kind']}{at} in run {run.get('name') or run['id']} (id {run['id']}) "
             f"in project {run['project']}"]
    if hp:
        lines.append("hyperparameters: " + " ".join(f"{n}={fmt(v)}" for n, (_, v) in list(hp.items())[:8]))
    if failure.get("message"):
        lines.append("message: " + " ".join(failure["message"].split())[:300])
    if failure.get("evidence"):
        lines.append("evidence: " + " ".join(failure["evidence"].split())[:400])
    return "\n".join(lines)
