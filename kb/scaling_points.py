"""The points a scaling law is fitted to, read off runs: loss, model size N, data D, compute C.

    points, skipped = collect(runs, y="val/loss", form="chinchilla")
    points, skipped = collect(runs, y="summary.loss", form="power", x="compute")
    fit = fit_runs(runs, y="val/loss", form="chinchilla", draws=200)     # a kb.scaling.ScalingFit

`y` is a key as queries spell it, resolved by the query language itself: `val/loss` is the
canonical metric (summary.val/loss, which an `eval_loss` run answers to through kb.vocab),
`summary.loss` a logged key, `stats."val/loss".best` a curve's best value. N is a run's
scale.params, D its scale.tokens, C its scale.flops or, when it has none, 6·N·D.

A run without a finite number at a key it needs is skipped (and named in `skipped`); data a
fit cannot be made from is an InvalidRecord naming what is wrong (kb.scaling.check): a value
that is not positive, too few points, a loss or a scale that never varies.
"""
from __future__ import annotations

import math

import numpy as np

from kb.errors import InvalidRecord, QueryError
from kb.fields import canonical, lookup
from kb.models import RunPublic
from kb.query import COLUMNS, parse_sort
from kb.scaling import DRAWS, REFINED_STARTS, Form, Points, ScalingFit, fit_points, form_named
from kb.vocab import canonical_hparams, with_canonical

XS = ("params", "tokens", "compute")
SCALE_KEY = {"N": "scale.params", "D": "scale.tokens", "C": "scale.flops"}


def resolve(key: str, what: str = "y") -> tuple[str, ...]:
    """The one key `key` names, as the query language resolves it (a canonical name included)."""
    keys = parse_sort(key)
    if len(keys) != 1 or keys[0][1]:
        raise QueryError(f"--{what} takes one key, like val/loss or summary.loss; got {key!r}")
    return keys[0][0]


def value(run: RunPublic, path: tuple[str, ...]):
    """A run's value at a resolved key, with the canonical names queries see; None when absent."""
    if path[0] in COLUMNS:
        return getattr(run, COLUMNS[path[0]][0], None)
    namespaces = with_canonical({"config": run.config, "summary": run.summary, "scale": run.scale,
                                 "stats": run.stats}, canonical_hparams(run.config))
    found, v = lookup(namespaces, path)
    return v if found else None


def _number(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _x_values(run: RunPublic, form: Form, x: str | None) -> dict[str, float | None]:
    n, d = _number(run.scale.get("params")), _number(run.scale.get("tokens"))
    if form.name == "chinchilla":
        return {"N": n, "D": d}
    if x == "params":
        return {"X": n}
    if x == "tokens":
        return {"X": d}
    c = _number(run.scale.get("flops"))
    return {"X": c if c is not None else (6 * n * d if n is not None and d is not None else None)}


def collect(runs: list[RunPublic], y: str, form: str | Form = "chinchilla",
            x: str | None = None) -> tuple[Points, list[dict]]:
    """(points, skipped runs with why) for fitting `form` to `y` over `runs`; kb.scaling.check
    (which fit_points calls) says whether a law can be fitted to them."""
    form = form if isinstance(form, Form) else form_named(form)
    x = _check_x(form, x)
    path = resolve(y)
    ykey = canonical(path)
    if not runs:
        raise InvalidRecord("no runs to fit (does --where match any?)", field="runs")
    ys, xs, ids, skipped = [], {v: [] for v in form.variables}, [], []
    for run in runs:
        raw = value(run, path)
        loss = _number(raw)
        scale = _x_values(run, form, x)
        lacking = ([ykey] if loss is None else []) + [_x_name(v, x) for v, s in scale.items() if s is None]
        if lacking:
            shown = f" ({raw!r})" if loss is None and raw is not None else ""      # e.g. a 'NaN' loss
            skipped.append({"run": run.id, "reason": f"no finite number at {', '.join(lacking)}{shown}"})
            continue
        ys.append(loss)
        ids.append(run.id)
        for v, s in scale.items():
            xs[v].append(s)
    if not ys:
        keys = [ykey] + [_x_name(v, x) for v in form.variables]
        raise InvalidRecord(f"none of the {len(runs)} runs has a finite number at every key the fit needs "
                            f"({', '.join(keys)}); first: {skipped[0]['run']}: {skipped[0]['reason']}", field=ykey)
    names = {"y": ykey} | {v: _x_name(v, x) for v in form.variables}
    return Points(np.array(ys), {v: np.array(vals) for v, vals in xs.items()}, tuple(ids), names), skipped


def fit_runs(runs: list[RunPublic], y: str, form: str = "chinchilla", x: str | None = None,
             draws: int = DRAWS, seed: int = 0, where: str | None = None,
             starts: int = REFINED_STARTS) -> ScalingFit:
    """A law fitted over runs (`where` is only recorded: the caller selected the runs)."""
    x = _check_x(form_named(form), x)
    points, skipped = collect(runs, y, form, x)
    meta = {"y": y, "x": x, "where": where, "skipped": skipped}
    return fit_points(points, form, draws=draws, seed=seed, starts=starts, meta=meta)


def _check_x(form: Form, x: str | None) -> str | None:
    if form.name == "chinchilla":
        if x is not None:
            raise InvalidRecord("a chinchilla law is in both N (scale.params) and D (scale.tokens); "
                                "--x is for --form power", field="x")
        return None
    x = x or "params"
    if x not in XS:
        raise InvalidRecord(f"unknown x {x!r}; known: {', '.join(XS)}", field="x")
    return x


def _x_name(variable: str, x: str | None) -> str:
    if variable == "X":
        return {"params": SCALE_KEY["N"], "tokens": SCALE_KEY["D"],
                "compute": "compute (scale.flops, else 6·scale.params·scale.tokens)"}[x]
    return SCALE_KEY[variable]
