"""`kb report`: a cited experiment report on an ablation, a hypothesis, or the runs a query selects.

    kb report abl-norm-1a2b3c4d5e                 # reports/abl-norm-1a2b3c4d5e/report.md + curves.png
    kb report hyp-0123456789 --html --out site/   # also report.html with an interactive chart
    kb report --where "project = 'gpt-sweep'"
"""
from __future__ import annotations

import click

from kb.cli.output import emit_json


def register(cli: click.Group) -> None:
    cli.add_command(report)


@click.command()
@click.argument("ref", required=False)
@click.option("--where", help="Report on the runs this query selects instead of an ablation or hypothesis.")
@click.option("--out", default="reports", show_default=True, type=click.Path(file_okay=False),
              help="Folder the report's own folder is written under.")
@click.option("--html", is_flag=True, help="Also write report.html with an interactive plotly chart.")
@click.option("--metric", help="The metric to judge (default: the ablation's, the hypothesis's, else val/loss).")
@click.option("--json", "as_json", is_flag=True, help="{markdown, html, figures, cited, verdicts}.")
@click.pass_obj
def report(obj, ref, where, out, html, metric, as_json):
    """Write a Markdown (and HTML) report on REF (an ablation or hypothesis id) or on --where EXPR."""
    from kb.reports import write_report
    written = write_report(obj.kb(), ref=ref, where=where, out=out, html=html, metric=metric)
    if as_json:
        emit_json(written.to_json())
        return
    click.echo(str(written.markdown))
    if written.html:
        click.echo(str(written.html))
