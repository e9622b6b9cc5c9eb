"""`kb scaling fit` and `kb scaling predict`: scaling laws over runs, with bootstrap intervals.

    kb scaling fit --y val/loss --form chinchilla --where "project = 'sweep'" --plot law.png
    kb scaling fit --y summary.loss --form power --x compute --json
    kb scaling predict --y val/loss --form chinchilla --params 7e10 --tokens 1.4e12
    kb scaling predict --y val/loss --form chinchilla --compute 5.76e23     # compute-optimal N, D
"""
from __future__ import annotations

import click

from kb.cli.output import emit_json, num

FORMS = ("chinchilla", "power")
XS = ("params", "tokens", "compute")


def register(cli: click.Group) -> None:
    cli.add_command(scaling)


@click.group()
def scaling():
    """Fit scaling laws over runs: L = E + A/N^α + B/D^β (chinchilla) or E + A·X^-α (power)."""


def _law_options(f):
    for option in reversed([
        click.option("--y", "y", required=True, help="The loss: a key as queries spell it (val/loss, summary.loss)."),
        click.option("--form", type=click.Choice(FORMS), default="chinchilla", show_default=True,
                     help="chinchilla: L(N, D) from scale.params and scale.tokens; power: L(X)."),
        click.option("--x", "x", type=click.Choice(XS), help="power only: X is scale.params (default), "
                     "scale.tokens, or compute (scale.flops, else 6·N·D)."),
        click.option("--where", help="Fit over the runs this query selects (default: all)."),
        click.option("--bootstrap", type=click.IntRange(min=0), default=200, show_default=True,
                     help="Bootstrap draws for the intervals (0: none)."),
        click.option("--seed", type=int, default=0, show_default=True, help="The bootstrap's random seed."),
        click.option("--json", "as_json", is_flag=True),
    ]):
        f = option(f)
    return f


def _fit(obj, y, form, x, where, bootstrap, seed):
    from kb.query import parse
    from kb.scaling_points import resolve
    if where:
        parse(where)          # a malformed query fails before the store is opened
    resolve(y)
    return obj.kb().scaling_fit(y=y, form=form, where=where, x=x, bootstrap=bootstrap, seed=seed)


@scaling.command()
@_law_options
@click.option("--plot", "plot_to", type=click.Path(dir_okay=False),
              help="Draw points, fit and interval: FILE.png (matplotlib) or FILE.html (plotly).")
@click.pass_obj
def fit(obj, y, form, x, where, bootstrap, seed, as_json, plot_to):
    """Fit a scaling law over runs and print its parameters with bootstrap intervals."""
    from kb.errors import InvalidRecord
    if plot_to and not plot_to.lower().endswith((".png", ".html")):
        raise InvalidRecord(f"{plot_to}: a plot is a .png (matplotlib) or an .html (plotly) file", field="--plot")
    law = _fit(obj, y, form, x, where, bootstrap, seed)
    if plot_to:
        from kb.scaling_plot import plot
        plot(law, plot_to)
    if as_json:
        emit_json(law.to_json())
        return
    _params_table(law)
    r, skipped = law.residual(), law.meta.get("skipped") or []
    click.echo(f"{len(law.runs)} runs" + (f" ({len(skipped)} skipped: no finite value; --json lists them)"
                                         if skipped else "") +
               f"; log residuals: rmse {r['rmse_log']:.4f}, max {r['max_abs_log']:.4f}; "
               f"{law.meta['wall_s']:.1f} s")
    if plot_to:
        click.echo(f"plot: {plot_to}")


@scaling.command()
@_law_options
@click.option("--params", "n", type=float, help="Model size N.")
@click.option("--tokens", "d", type=float, help="Training tokens D.")
@click.option("--compute", "c", type=float, help="Compute C in FLOPs; chinchilla: the compute-optimal N and D.")
@click.pass_obj
def predict(obj, y, form, x, where, bootstrap, seed, as_json, n, d, c):
    """Predicted loss with its interval at (N, D) or X, or the compute-optimal N, D for a budget C."""
    from kb.errors import InvalidRecord
    from kb.scaling import prediction
    if n is None and d is None and c is None:
        raise InvalidRecord("say where: --params N --tokens D, or --compute C", field="predict")
    law = _fit(obj, y, form, x, where, bootstrap, seed)
    out = prediction(law, params=n, tokens=d, compute=c)
    if as_json:
        emit_json(out)
        return
    _estimates_table(f"{form} law over {out['n']} runs, at " + ", ".join(f"{k}={num(v)}" for k, v in out["at"].items()),
                     {str(y): out["predicted"], **out.get("optimal", {})}, law.level)


def _params_table(law) -> None:
    _estimates_table(f"{law.form.name} law for {law.meta.get('y')}", {k: v.as_dict() for k, v in law.params.items()},
                     law.level)


def _estimates_table(title: str, rows: dict[str, dict], level: float) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=title, title_justify="left")
    t.add_column("")
    for name in ("value", f"{level:.0%} low", f"{level:.0%} high"):
        t.add_column(name, justify="right")
    for name, e in rows.items():
        t.add_row(name, *(_g(e[k]) for k in ("value", "low", "high")))
    Console(soft_wrap=True).print(t)


def _g(v) -> str:
    return "-" if v is None else f"{v:.4g}"
