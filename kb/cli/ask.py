"""`kb ask`: a question about past experiments, answered with citations (and the SQL it ran)."""
from __future__ import annotations

import click

from kb.cli.output import emit_json


def register(cli: click.Group) -> None:
    cli.add_command(ask)


@click.command()
@click.argument("question")
@click.option("--json", "as_json", is_flag=True, help="The contract's Answer: {answer, citations, sql}.")
@click.pass_obj
def ask(obj, question, as_json):
    """Answer QUESTION from the knowledge base; every sentence cites its records."""
    from kb.errors import InvalidRecord
    if not question.strip():
        raise InvalidRecord("question: empty; ask something, e.g. kb ask \"which lr diverged at 350M?\"")
    kb = obj.kb()
    kb.try_sync_index()
    answer = kb.ask(question)
    if as_json:
        emit_json(answer.as_dict())
        return
    click.echo(answer.text)
    if answer.citations:
        click.echo("")
        for i, c in enumerate(answer.citations, 1):
            click.echo(f"[{i}] {c.kind} {c.id}" + (f"  {c.quote}" if c.quote else ""))
    if answer.sql:
        click.echo(f"\nSQL:\n{answer.sql}")
