"""A report as blocks (headings, paragraphs, tables, lists, figures), written as Markdown and HTML,
and the curve figures beside it: a PNG by matplotlib for the Markdown, an interactive plotly chart
for the HTML (its script written once beside the report, so the page opens offline).
"""
from __future__ import annotations

import html
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

CITE = re.compile(r"\[([^\[\]\s]+)\]")      # a citation: [run-id], [abl-...], [hyp-...]


@dataclass
class Block:
    kind: str                       # h1 | h2 | p | list | table | figure
    text: str = ""
    items: list = field(default_factory=list)       # list items, or table rows
    header: list = field(default_factory=list)


def cited_ids(blocks: list[Block]) -> list[str]:
    """Every id the report cites, in order of first citation."""
    found: dict[str, None] = {}
    for b in blocks:
        texts = [b.text] + [c for row in b.items for c in (row if isinstance(row, list) else [row])]
        for t in texts:
            for m in CITE.finditer(str(t)):
                found.setdefault(m.group(1))
    return list(found)


def markdown(blocks: list[Block]) -> str:
    out = []
    for b in blocks:
        if b.kind == "h1":
            out.append(f"# {b.text}")
        elif b.kind == "h2":
            out.append(f"## {b.text}")
        elif b.kind == "p":
            out.append(b.text)
        elif b.kind == "list":
            out.append("\n".join(f"- {i}" for i in b.items))
        elif b.kind == "table":
            rows = [b.header, ["---"] * len(b.header)] + b.items
            out.append("\n".join("| " + " | ".join(_cell(c) for c in r) + " |" for r in rows))
        elif b.kind == "figure":
            out.append(f"![{b.text}]({b.items[0]})")
    return "\n\n".join(out) + "\n"


def _cell(c) -> str:
    return str(c).replace("|", "\\|").replace("\n", " ")


def html_page(blocks: list[Block], title: str, charts: dict[str, str]) -> str:
    """The same blocks as one HTML page; a figure with a chart in `charts` (its PNG name -> plotly
    div) shows the interactive chart instead of the image."""
    body = []
    for b in blocks:
        if b.kind in ("h1", "h2"):
            body.append(f"<{b.kind}>{_inline(b.text)}</{b.kind}>")
        elif b.kind == "p":
            body.append(f"<p>{_inline(b.text)}</p>")
        elif b.kind == "list":
            body.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in b.items) + "</ul>")
        elif b.kind == "table":
            head = "".join(f"<th>{_inline(h)}</th>" for h in b.header)
            rows = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in b.items)
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif b.kind == "figure":
            name = b.items[0]
            body.append(charts.get(name) or f'<img src="{html.escape(name)}" alt="{html.escape(b.text)}">')
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto;line-height:1.4}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .5em;text-align:left}"
             "code{background:#f4f4f4}")
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{style}</style><script src=\"plotly.min.js\"></script></head><body>{''.join(body)}</body></html>\n")


def _inline(text) -> str:
    """Markdown's inline code (`x`) as <code>; everything else escaped."""
    parts = str(text).split("`")
    return "".join(f"<code>{html.escape(p)}</code>" if i % 2 else html.escape(p) for i, p in enumerate(parts))


# ---- figures -------------------------------------------------------------------------------------

Curves = dict[str, list[tuple[float, float]]]      # label -> [(step, value)], non-finite values dropped


def finite_points(points) -> list[tuple[float, float]]:
    return [(p[0], p[1]) for p in points
            if isinstance(p[1], (int, float)) and not isinstance(p[1], bool) and math.isfinite(p[1])]


def curve_png(curves: Curves, metric: str, path: Path) -> Path:
    """The curves as a PNG (matplotlib's Agg canvas: no display, no global pyplot state)."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot()
    for label, pts in curves.items():
        if pts:
            ax.plot([s for s, _ in pts], [v for _, v in pts], label=label, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    if len(curves) <= 12:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    return path


def curve_chart(curves: Curves, metric: str) -> str:
    """The curves as a plotly div (the page loads plotly.min.js from beside it)."""
    import plotly.graph_objects as go
    fig = go.Figure()
    for label, pts in curves.items():
        fig.add_trace(go.Scatter(x=[s for s, _ in pts], y=[v for _, v in pts], mode="lines", name=label))
    fig.update_layout(xaxis_title="step", yaxis_title=metric, height=420, margin=dict(l=60, r=20, t=20, b=50))
    return fig.to_html(full_html=False, include_plotlyjs=False)


def write_plotly_js(folder: Path) -> None:
    target = folder / "plotly.min.js"
    if not target.exists():
        from plotly.offline import get_plotlyjs
        target.write_text(get_plotlyjs(), encoding="utf-8")
