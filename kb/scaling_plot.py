"""A fitted scaling law drawn over its points, with the bootstrap interval as a band.

    plot(fit, "law.png")      # matplotlib (Agg): a static image for a report or a README
    plot(fit, "law.html")     # plotly: hover over a point to see its run
    plotly_figure(fit)        # the same plotly figure, for a page to draw

A power law is loss against X on log-log axes. A Chinchilla law is loss against N with one
curve per fifth of the runs by compute (6·N·D = C fixed at their median, over their range of
N), each marked at its compute-optimal N: the IsoFLOP view of Hoffmann et al.'s Figure 3, points coloured by C.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kb.errors import InvalidRecord
from kb.scaling import ScalingFit, log_predicted

BUDGETS = 5                             # curves, one per fifth of the runs by compute
SAMPLES = 160                           # points along a curve
AXIS = {"params": "parameters N", "tokens": "tokens D", "compute": "compute C (FLOPs)"}
MARGIN = 1.5                            # curves run this factor past the data on each side


@dataclass
class Curve:
    label: str
    x: np.ndarray
    value: np.ndarray
    low: np.ndarray | None
    high: np.ndarray | None
    shade: float | None = None          # 0..1 along the colour scale (a budget), None: one colour
    best: tuple[float, float] | None = None     # (x, loss) of the curve's minimum


@dataclass
class Figure:
    title: str
    xlabel: str
    ylabel: str
    x: np.ndarray                       # the points
    y: np.ndarray
    runs: tuple[str, ...]
    shade: np.ndarray | None            # 0..1 per point, None: one colour
    shade_label: str
    shade_range: tuple[float, float]    # what 0 and 1 stand for (log10 of compute)
    curves: list[Curve]


def plot(fit: ScalingFit, path: str | Path) -> Path:
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".png", ".html"):
        raise InvalidRecord(f"{path}: a plot is a .png (matplotlib) or an .html (plotly) file", field="plot")
    figure = _figure(fit)
    (_png if suffix == ".png" else _html)(figure, path)
    return path


def _band(fit: ScalingFit, logx: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    value = np.exp(log_predicted(fit.theta, logx))
    if not len(fit.boot):
        return value, None, None
    draws = np.exp(log_predicted(fit.boot, logx))
    tail = 100 * (1 - fit.level) / 2
    low, high = np.nanpercentile(draws, [tail, 100 - tail], axis=0)
    return value, low, high


def _span(values: np.ndarray) -> np.ndarray:
    return np.geomspace(values.min() / MARGIN, values.max() * MARGIN, SAMPLES)


def _figure(fit: ScalingFit) -> Figure:
    p, y = fit.points, fit.points.y
    ylabel = str(fit.meta.get("y") or "loss")
    level = f"{fit.level:.0%} interval, {len(fit.boot)} bootstrap draws" if len(fit.boot) else "no bootstrap"
    if fit.form.name == "power":
        x = p.x["X"]
        xs = _span(x)
        value, low, high = _band(fit, np.log(xs)[:, None])
        e = fit.params
        label = f"E + A·X^-α: E={e['E'].value:.3g}, A={e['A'].value:.3g}, α={e['alpha'].value:.3g}"
        x_name = fit.meta.get("x") or "params"
        return Figure(f"power law in {x_name} ({level})", AXIS.get(x_name, x_name),
                      ylabel, x, y, p.runs, None, "", (0.0, 1.0), [Curve(label, xs, value, low, high)])
    n, d = p.x["N"], p.x["D"]
    logc = np.log10(6 * n * d)
    lo, hi = float(logc.min()), float(logc.max())
    width = (hi - lo) or 1.0
    curves = []
    edges = np.quantile(logc, np.linspace(0, 1, BUDGETS + 1))
    for i in range(BUDGETS):
        near = (logc >= edges[i]) & (logc <= edges[i + 1])      # the runs this budget stands for
        c = 10 ** float(np.median(logc[near]))
        ns = _span(n[near])
        value, low, high = _band(fit, np.log(np.column_stack([ns, c / (6 * ns)])))
        opt = fit.compute_optimal(c)
        curves.append(Curve(f"C = {c:.2g} FLOPs", ns, value, low, high, (np.log10(c) - lo) / width,
                            (opt["params"].value, opt["loss"].value)))
    return Figure(f"L(N, D) = E + A/N^α + B/D^β at fixed compute ({level})", "parameters N", ylabel,
                  n, y, p.runs, (logc - lo) / width, "log10 compute (6ND)", (lo, hi), curves)


def _png(fig: Figure, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")            # no display: a file is the only output
    import matplotlib.pyplot as plt
    from matplotlib.colors import Normalize
    from matplotlib.ticker import ScalarFormatter

    cmap = plt.get_cmap("viridis")
    f, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    for c in fig.curves:
        color = cmap(c.shade) if c.shade is not None else "C1"
        if c.low is not None:
            ax.fill_between(c.x, c.low, c.high, color=color, alpha=0.18, linewidth=0)
        ax.plot(c.x, c.value, color=color, label=c.label)
        if c.best:
            ax.plot(*c.best, marker="*", color=color, markersize=11, markeredgecolor="black")
    if fig.shade is None:
        ax.scatter(fig.x, fig.y, s=14, color="C0", label="runs", zorder=3)
    else:
        dots = ax.scatter(fig.x, fig.y, s=14, c=fig.shade, cmap=cmap, norm=Normalize(0, 1),
                          edgecolors="black", linewidths=0.3, zorder=3)
        bar = f.colorbar(dots, ax=ax)
        ticks = np.linspace(0, 1, 5)
        bar.set_ticks(ticks, labels=[f"{fig.shade_range[0] + t * (fig.shade_range[1] - fig.shade_range[0]):.1f}"
                                     for t in ticks])
        bar.set_label(fig.shade_label)
    ax.set(xscale="log", yscale="log", xlabel=fig.xlabel, ylabel=fig.ylabel, title=fig.title)
    ax.yaxis.set_major_formatter(ScalarFormatter())     # losses span less than a decade: 3, not 3×10^0
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.title.set_fontsize(10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.2)
    f.tight_layout()
    f.savefig(path)
    plt.close(f)


def plotly_figure(fit: ScalingFit):
    """The plotly figure `plot(fit, "law.html")` writes: points, fitted curve(s), interval band(s),
    for a page that draws it itself (the UI's Scaling tab)."""
    return _plotly(_figure(fit))


def _html(fig: Figure, path: Path) -> None:
    _plotly(fig).write_html(path, include_plotlyjs=True)     # one self-contained file, readable offline


def _plotly(fig: Figure):
    import plotly.graph_objects as go
    from plotly.colors import sample_colorscale

    out = go.Figure()
    for c in fig.curves:
        color = sample_colorscale("Viridis", [c.shade])[0] if c.shade is not None else "#ff7f0e"
        if c.low is not None:
            out.add_trace(go.Scatter(x=np.concatenate([c.x, c.x[::-1]]), y=np.concatenate([c.high, c.low[::-1]]),
                                     fill="toself", fillcolor=color, opacity=0.18, line={"width": 0},
                                     hoverinfo="skip", showlegend=False))
        out.add_trace(go.Scatter(x=c.x, y=c.value, mode="lines", line={"color": color}, name=c.label))
        if c.best:
            out.add_trace(go.Scatter(x=[c.best[0]], y=[c.best[1]], mode="markers", showlegend=False,
                                     marker={"symbol": "star", "size": 13, "color": color,
                                             "line": {"color": "black", "width": 1}},
                                     hovertext=f"compute-optimal N for {c.label}"))
    marker = {"size": 6, "line": {"color": "black", "width": 0.5}}
    if fig.shade is not None:
        lo, hi = fig.shade_range
        marker |= {"color": lo + fig.shade * (hi - lo), "colorscale": "Viridis", "cmin": lo, "cmax": hi,
                   "colorbar": {"title": {"text": fig.shade_label}}}
    out.add_trace(go.Scatter(x=fig.x, y=fig.y, mode="markers", name="runs", marker=marker,
                             text=list(fig.runs), hovertemplate="%{text}<br>x=%{x:.3g}<br>y=%{y:.4g}"))
    out.update_layout(title=fig.title, xaxis_title=fig.xlabel, yaxis_title=fig.ylabel, template="plotly_white",
                      legend={"x": 0.01, "y": 0.01, "xanchor": "left", "yanchor": "bottom"})
    out.update_xaxes(type="log")
    out.update_yaxes(type="log")
    return out
