"""The Scaling tab: a scaling law fitted over the runs a query selects (`kb scaling fit`), its
parameters with bootstrap intervals, the points and fitted curves with their interval band, and
for a compute budget the compute-optimal N and D with the predicted loss (`kb scaling predict
--compute C`), marked on the figure.

The fit is kept in the page's state: a new budget asks it, without fitting again. The layout
helpers (`param_rows`, `budget_markdown`, `fit_figure`) are tested without a browser.
"""
from __future__ import annotations

import gradio as gr
import numpy as np

from kb.errors import InvalidRecord, KBError
from kb.scaling import prediction
from kb.scaling_plot import plotly_figure
from kb.ui.records import problem

ID, TITLE = "scaling", "Scaling"
FORMS = ("chinchilla", "power")
XS = ("params", "tokens", "compute")
BUDGET_SPAN = 30.0          # the budget's iso-FLOP curve runs this factor either side of its optimal N
BUDGET_SAMPLES = 60


# ---- layout -------------------------------------------------------------------------------------

def _g(v) -> str:
    return "-" if v is None else f"{v:.4g}"


def param_rows(fit) -> list[list[str]]:
    """[name, value, low, high] per parameter, as `kb scaling fit` prints them."""
    return [[name, _g(e.value), _g(e.low), _g(e.high)] for name, e in fit.params.items()]


def summary_markdown(fit) -> str:
    r, skipped = fit.residual(), fit.meta.get("skipped") or []
    level = f"{fit.level:.0%} bootstrap intervals over {len(fit.boot)} draws" if len(fit.boot) else "no bootstrap"
    text = (f"**{fit.form.name}** law for `{fit.meta.get('y')}` over {len(fit.runs)} runs ({level}); "
            f"log residuals: rmse {r['rmse_log']:.4f}, max {r['max_abs_log']:.4f}; {fit.meta.get('wall_s', 0):.1f} s.")
    if skipped:
        shown = "; ".join(f"{s['run']}: {s['reason']}" for s in skipped[:5])
        text += f"\n\n{len(skipped)} run(s) skipped: {shown}" + (" …" if len(skipped) > 5 else "")
    return text


def _interval(e: dict) -> str:
    return f"{_g(e['value'])}" + (f" ({_g(e['low'])} to {_g(e['high'])})" if e.get("low") is not None else "")


def budget_markdown(at: dict, y: str) -> str:
    """`kb scaling predict --compute C` as text: the compute-optimal N, D and loss, or the loss at C."""
    c = at["at"].get("compute")
    head = f"**At C = {c:.3g} FLOPs**" if c is not None else "**Prediction**"
    lines = [head]
    optimal = at.get("optimal")
    if optimal:
        lines.append(f"- compute-optimal N (parameters): {_interval(optimal['params'])}")
        lines.append(f"- compute-optimal D (tokens): {_interval(optimal['tokens'])}")
        lines.append(f"- tokens per parameter: {_interval(optimal['tokens_per_param'])}")
    lines.append(f"- predicted {y}: {_interval(at['predicted'])}")
    return "\n".join(lines)


def fit_figure(fit, at: dict | None = None):
    """The fit's plotly figure (kb.scaling_plot: points, curves, interval bands); with a budget's
    prediction, its iso-FLOP curve and its compute-optimal point, the intervals of N and of the
    loss as error bars."""
    import plotly.graph_objects as go
    fig = plotly_figure(fit)
    # the legend below the axes: inside them (as the file's figure has it) it hides points at this size
    fig.update_layout(height=620, legend={"orientation": "h", "x": 0, "y": -0.18, "xanchor": "left", "yanchor": "top"},
                      title={"font": {"size": 13}}, margin={"l": 60, "r": 20, "t": 50, "b": 40})
    if not at:
        return fig
    p = at["predicted"]
    bar = {"type": "data", "symmetric": False, "array": [p["high"] - p["value"]],
           "arrayminus": [p["value"] - p["low"]]} if p.get("low") is not None else None
    optimal, c = at.get("optimal"), at["at"].get("compute")
    if optimal and c:
        n_opt = optimal["params"]["value"]
        ns = np.geomspace(n_opt / BUDGET_SPAN, n_opt * BUDGET_SPAN, BUDGET_SAMPLES)
        losses = [fit.predict(N=n, D=c / (6 * n)).value for n in ns]
        fig.add_trace(go.Scatter(x=ns, y=losses, mode="lines", name=f"budget C = {c:.2g}",
                                 line={"color": "crimson", "dash": "dash"}))
        x = n_opt
        e = optimal["params"]
        across = {"type": "data", "symmetric": False, "array": [e["high"] - n_opt],
                  "arrayminus": [n_opt - e["low"]]} if e.get("low") is not None else None
    elif fit.form.name == "power":
        x, across = at["at"].get(fit.meta.get("x") or "params"), None
    else:
        return fig
    star = {"symbol": "star", "size": 16, "color": "crimson", "line": {"color": "black", "width": 1}}
    fig.add_trace(go.Scatter(x=[x], y=[p["value"]], mode="markers", name="compute-optimal" if optimal else "predicted",
                             error_y=bar, error_x=across, marker=star))
    return fig


def parse_budget(text: str) -> float | None:
    text = (text or "").strip().replace("_", "").replace(",", "")
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise InvalidRecord(f"{text!r} is not a number of FLOPs (write 1e21)", field="compute") from None
    if not np.isfinite(value) or value <= 0:
        raise InvalidRecord(f"{text!r}: a compute budget is a positive number of FLOPs", field="compute")
    return value


def budget_prediction(fit, budget: float) -> dict:
    """kb.scaling.prediction at the budget: Chinchilla's compute-optimal point, or a power law in
    compute's loss there."""
    if fit.form.name == "power" and (fit.meta.get("x") or "params") != "compute":
        raise InvalidRecord(f"this power law is in {fit.meta.get('x') or 'params'}, not compute: fit chinchilla "
                            "(the compute-optimal N and D) or a power law with x = compute", field="compute")
    return prediction(fit, compute=budget)


# ---- the tab ------------------------------------------------------------------------------------

def build(ui) -> None:
    kb = ui.kb
    with gr.Row():
        where = gr.Textbox(label="Runs (a query; empty: all)", placeholder="project = 'sweep' and status = 'completed'",
                           scale=4, elem_id="scaling-where")
        y = gr.Textbox(value="val/loss", label="Loss (y)", scale=1, elem_id="scaling-y")
        form = gr.Dropdown(list(FORMS), value="chinchilla", label="Law", scale=1, elem_id="scaling-form")
        x = gr.Dropdown(list(XS), value="params", label="x (power law)", scale=1, visible=False)
        draws = gr.Number(value=200, precision=0, minimum=0, maximum=2000, label="Bootstrap draws", scale=1,
                          elem_id="scaling-draws")
    with gr.Row():
        budget = gr.Textbox(label="Compute budget C (FLOPs)", placeholder="1e21", scale=2, elem_id="scaling-budget")
        fit_button = gr.Button("Fit", variant="primary", scale=1, elem_id="scaling-fit")
        ask = gr.Button("Compute-optimal point", scale=1, elem_id="scaling-optimal")
    said = gr.Markdown(elem_id="scaling-message")
    with gr.Row():
        with gr.Column(scale=2):
            params = gr.Dataframe(headers=["parameter", "value", "low", "high"], interactive=False,
                                  label="Fitted parameters", elem_id="scaling-params")
            optimal = gr.Markdown(elem_id="scaling-budget-result")
        with gr.Column(scale=3):
            plot = gr.Plot(label="Fit", elem_id="scaling-plot")
    fitted = gr.State(None)

    def at_budget(fit, text: str):
        """(budget text, its prediction or None), or raises for a bad budget."""
        c = parse_budget(text)
        return (None, None) if c is None else (c, budget_prediction(fit, c))

    def run_fit(query: str, key: str, law: str, xname: str, n_draws, text: str):
        try:
            fit = kb.scaling_fit(y=(key or "").strip() or "val/loss", form=law, where=(query or "").strip() or None,
                                 x=xname if law == "power" else None, bootstrap=int(n_draws or 0))
        except KBError as exc:
            return problem(exc), gr.skip(), "", gr.skip(), None
        message = summary_markdown(fit)
        try:
            _, at = at_budget(fit, text)
        except KBError as exc:
            at, extra = None, problem(exc)
        else:
            extra = budget_markdown(at, fit.meta.get("y")) if at else ""
        return message, param_rows(fit), extra, fit_figure(fit, at), fit

    def run_budget(fit, text: str):
        if fit is None:
            return "Fit a law first.", gr.skip()
        try:
            c, at = at_budget(fit, text)
        except KBError as exc:
            return problem(exc), gr.skip()
        if c is None:
            return "Give a compute budget in FLOPs (e.g. 1e21).", gr.skip()
        return budget_markdown(at, fit.meta.get("y")), fit_figure(fit, at)

    inputs = [where, y, form, x, draws, budget]
    outputs = [said, params, optimal, plot, fitted]
    form.change(lambda law: gr.update(visible=law == "power"), form, x)
    fit_button.click(run_fit, inputs, outputs)
    where.submit(run_fit, inputs, outputs)
    ask.click(run_budget, [fitted, budget], [optimal, plot])
    budget.submit(run_budget, [fitted, budget], [optimal, plot])
