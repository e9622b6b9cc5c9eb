"""Plotly figures of training curves, the way W&B draws them: one line per run, an EMA smoothing
slider (the raw curve stays behind it, faint), log axes, and what went wrong marked on the curve.

    from kb.ui.curves import Series, Mark, curves_figure, ema
    fig = curves_figure([Series("lr3e-4", [[0, 4.1], [100, 3.2]]),
                         Series("lr1e-2", [[0, 4.1], [60, "NaN"]], diverged_at=60)],
                        "val/loss", log_y=True, smoothing=0.6)
    gr.Plot(fig)

Pure functions of their input (no KnowledgeBase here), so any tab can draw with them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import plotly.graph_objects as go
from plotly.colors import qualitative

PALETTE = qualitative.Plotly + qualitative.D3
HEIGHT = 420
MARK_SYMBOLS = {"loss_spike": "x", "grad_spike": "x", "plateau": "diamond", "divergence": "triangle-up"}


@dataclass
class Mark:
    """Something found at a step of a curve: an anomaly (loss_spike, plateau, ...) or a failure."""
    step: int
    kind: str
    text: str = ""
    value: float | None = None      # where on the curve; None: read off the curve at `step`


@dataclass
class Series:
    label: str                              # the legend's name for the run
    points: Sequence[Sequence[Any]]         # [[step, value, (wall_time)], ...]; "NaN"/None allowed
    marks: list[Mark] = field(default_factory=list)
    diverged_at: int | None = None          # a dashed vertical line at this step
    link: str = ""                          # shown in the hover text (a run id)


def color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def number(v: Any) -> float | None:
    """A curve value as a finite float, or None (NaN, ±inf, "NaN", null, text): a gap in the line."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def ema(values: Sequence[float | None], weight: float) -> list[float | None]:
    """TensorBoard's and W&B's exponential moving average, debiased so the start is not pulled
    towards zero: s_n = (w·a_{n-1} + (1-w)·x_n) / (1 - w^n). Gaps (None) stay gaps and do not
    move the average; weight 0 returns the values unchanged."""
    if not 0 <= weight < 1:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    out: list[float | None] = []
    acc, n = 0.0, 0
    for v in values:
        if v is None:
            out.append(None)
            continue
        acc = weight * acc + (1 - weight) * v
        n += 1
        out.append(acc / (1 - weight ** n))
    return out


def curves_figure(series: Sequence[Series], metric: str, *, log_x: bool = False, log_y: bool = False,
                  smoothing: float = 0.0, title: str | None = None) -> go.Figure:
    """One line per run of `metric` against step. With smoothing, the line is the EMA and the raw
    curve is drawn faint underneath (same colour, no legend entry). Anomalies are markers on the
    curve (one trace per kind, so the legend toggles them); a divergence is a dashed vertical line."""
    fig = go.Figure()
    marks: dict[str, tuple[list, list, list]] = {}
    for i, s in enumerate(series):
        steps = [p[0] for p in s.points]
        values = [number(p[1]) for p in s.points]
        shown = ema(values, smoothing) if smoothing else values
        hover = f"{s.label}<br>step %{{x}}<br>{metric} %{{y:.4g}}<extra></extra>"
        if smoothing:
            fig.add_trace(go.Scatter(x=steps, y=values, mode="lines", name=f"{s.label} (raw)",
                                     legendgroup=s.label, showlegend=False, hoverinfo="skip",
                                     line=dict(color=color(i), width=1), opacity=0.25))
        fig.add_trace(go.Scatter(x=steps, y=shown, mode="lines", name=s.label, legendgroup=s.label,
                                 line=dict(color=color(i), width=2), hovertemplate=hover,
                                 meta={"run": s.link or s.label}))
        for m in s.marks:
            y = m.value if number(m.value) is not None else _at(steps, shown, m.step)
            if y is None:
                continue
            xs, ys, texts = marks.setdefault(m.kind, ([], [], []))
            xs.append(m.step)
            ys.append(y)
            texts.append(f"{s.label}: {m.text or m.kind.replace('_', ' ')} at step {m.step}")
        if s.diverged_at is not None:
            fig.add_vline(x=s.diverged_at, line=dict(color=color(i), dash="dash", width=1.5),
                          annotation=dict(text=f"{s.label} diverged", font=dict(size=11, color=color(i))),
                          annotation_position="top left")
    for kind, (xs, ys, texts) in marks.items():
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", name=kind.replace("_", " "), text=texts,
                                 hovertemplate="%{text}<extra></extra>",
                                 marker=dict(symbol=MARK_SYMBOLS.get(kind, "circle-open"), size=11,
                                             color="#d62728", line=dict(width=2, color="#d62728"))))
    style(fig, "step", metric, log_x=log_x, log_y=log_y, title=title)
    return fig


def style(fig: go.Figure, x_title: str, y_title: str, *, log_x: bool = False, log_y: bool = False,
          title: str | None = None, height: int = HEIGHT) -> go.Figure:
    """The house look: white background, axis titles, legend under the plot, log axes on request."""
    fig.update_layout(template="plotly_white", height=height, margin=dict(l=60, r=20, t=50 if title else 30, b=40),
                      title=dict(text=title) if title else None, hovermode="closest",
                      legend=dict(orientation="h", yanchor="top", y=-0.15, xanchor="left", x=0))
    fig.update_xaxes(title_text=x_title, type="log" if log_x else "linear", showgrid=True)
    fig.update_yaxes(title_text=y_title, type="log" if log_y else "linear", showgrid=True)
    return fig


def _at(steps: list, values: list, step: int) -> float | None:
    """The curve's value at `step`, or the last finite one before it (a NaN point has no height)."""
    best = None
    for x, y in zip(steps, values):
        if x is not None and x > step:
            break
        if y is not None:
            best = y
    return best
