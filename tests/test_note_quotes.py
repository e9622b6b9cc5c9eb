"""Which line of a note an explanation quotes about a run (agents.explain.line_about): the line
that names it, a Markdown table row given with its header, never a bare header or table rule."""
from __future__ import annotations

from pathlib import Path

from agents.explain import line_about

LOGS_README = Path(__file__).resolve().parent / "data" / "logs" / "README.md"


def test_a_table_row_naming_the_run_is_quoted_with_its_header():
    """The repo's real fixtures README (a table of the logs it holds): the row of nemo_nan.log,
    not the table's header, which an earlier version quoted as what "a note on it says"."""
    line, verb = line_about(LOGS_README.read_text(), ("nemo_nan", "nemo_nan"))
    assert verb == "lists"
    assert line.startswith("file: nemo_nan.log; what printed it: NeMo") and "| " not in line, line


def test_prose_naming_the_run_is_quoted_as_it_is_and_the_title_line_is_skipped():
    text = "Postmortem r042\nWe lost two days.\nRun r042 diverged at step 9000 after the lr warmup ended."
    assert line_about(text, ("r042", "350m-lr3e-3")) == \
        ("Run r042 diverged at step 9000 after the lr warmup ended.", "says")
    # named in the title only: the first line of prose, not a heading, fence or table line
    text = "Postmortem r042\n# Timeline\n| day | what |\n|---|---|\n| 1 | restart |\nNodes were drained first."
    assert line_about(text, ("r042",)) == ("Nodes were drained first.", "says")


def test_a_row_whose_table_header_is_elsewhere_gives_its_cells_and_a_chunk_of_tables_gives_nothing():
    # a chunk that starts inside a table: the header went with the chunk before
    assert line_about("Logs (2)\n| `run7.log` | NeMo | issue #1 |", ("run7",)) == ("run7.log, NeMo, issue #1", "lists")
    assert line_about("Title\n| a | b |\n|---|---|\n| x | y |", ("q",)) == (None, "")
