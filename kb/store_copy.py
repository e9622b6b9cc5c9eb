"""Copy a whole knowledge base's SQL store into another database: the move from the embedded
default (SQLite under .kb) to the team's PostgreSQL, or back.

    copied = copy_store(make_engine("sqlite:///.kb/kb.sqlite"), make_engine("postgresql://kb@db/kb"))

The target is brought to the current schema first and must hold no runs, notes, hypotheses or
jobs. Every table is copied in foreign-key order, in pages, inside one transaction on the target:
an interrupted copy leaves the target as it was. PostgreSQL's id sequences are moved past the
copied ids, so new rows do not collide. Vectors are not copied: they are derived from SQL, and
`kb reindex` against the target's index rebuilds them (the same records give the same vectors).
"""
from __future__ import annotations

from typing import Callable

from sqlalchemy import Integer, func, select, text
from sqlalchemy.engine import Engine
from sqlmodel import SQLModel

from kb import models  # noqa: F401 - registers every table on SQLModel.metadata
from kb.db import migrate
from kb.errors import KBError

PAGE = 5000
USER_TABLES = ("run", "note", "hypothesis", "job")      # a target holding any of these is in use


def copy_store(source: Engine, target: Engine, progress: Callable[[str, int], None] | None = None) -> dict[str, int]:
    """Rows copied per table. Raises KBError when the target already holds records."""
    if source.url == target.url:
        raise KBError("the source and the target are the same database")
    migrate(source)
    migrate(target)
    tables = SQLModel.metadata.sorted_tables
    with target.connect() as conn:
        used = {t.name: conn.execute(select(func.count()).select_from(t)).scalar_one()
                for t in tables if t.name in USER_TABLES}
    if any(used.values()):
        held = ", ".join(f"{n} {name}s" for name, n in used.items() if n)
        raise KBError(f"the target database already holds {held}: copy into an empty one")
    copied: dict[str, int] = {}
    with source.connect() as src, target.begin() as dst:
        for table in tables:
            # rows no user wrote may be there (the MLflow "Default" experiment a server makes)
            dst.execute(table.delete())
            n = 0
            for page in src.execution_options(yield_per=PAGE).execute(select(table)).mappings().partitions(PAGE):
                dst.execute(table.insert(), [dict(row) for row in page])
                n += len(page)
                if progress:
                    progress(table.name, n)
            copied[table.name] = n
        if target.dialect.name == "postgresql":
            _advance_sequences(dst, tables)
    return copied


def _advance_sequences(conn, tables) -> None:
    for table in tables:
        keys = list(table.primary_key.columns)
        if len(keys) != 1 or not isinstance(keys[0].type, Integer) or keys[0].autoincrement is False:
            continue
        column = keys[0].name
        sequence = conn.execute(text("select pg_get_serial_sequence(:t, :c)"),
                                {"t": table.name, "c": column}).scalar()
        if sequence:
            conn.execute(text(f'select setval(:s, coalesce((select max("{column}") from "{table.name}"), 0) + 1, false)'),
                         {"s": sequence})
