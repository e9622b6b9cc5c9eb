"""`Text`: the type of every string a request carries. What SQL cannot hold (a NUL, which Postgres
text refuses; a lone surrogate, which is no Unicode) is a 422 naming the parameter, not a
database error: the same rule records follow (kb.records.text_problem).

A required query parameter is written `name: Annotated[Text, Query()]`: FastAPI 0.165 drops the
validator of `name: Text = Query(...)` (and of `Text = Query(None)`), so a NUL reached Postgres
as a 500. tests/test_server.py sends one to every string parameter of every operation."""
from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

from kb.records import text_problem


def _storable(value: str) -> str:
    if problem := text_problem(value):
        raise ValueError(problem)
    return value


Text = Annotated[str, AfterValidator(_storable)]
