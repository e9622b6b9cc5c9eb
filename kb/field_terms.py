"""Postgres's term index: each run's equality-testable fields as one array of exact terms.

A filter of several equalities (`lr = X and batch_size = Y and warmup = Z`) matches few runs,
but each test alone matches many: planned over RunField, the query reads one test's whole
index range (10,000 rows of 100,000 runs) and probes the other keys of each of those runs. A
run's terms, one `text[]` per run under a GIN index, let Postgres intersect the tests' posting
lists instead and read only the runs that match them all (at 106,000 runs, three 10%
equalities: the best 20 of ~100 matches in 4.5 ms, where the RunField plan took 25.1 ms;
benchmarks/postgres_terms.py).

A term spells one RunField row exactly, so containment is the test itself, not a hint to
recheck: `{vtype}{len(key)}:{key}{value}`, the value a string's text, a number's or bool's
IEEE-754 bytes in hex (the float the test compares; -0 as 0, which `=` does not tell apart),
nothing for null. The key's length makes the spelling unambiguous whatever the key holds.

Only fields a person filters by equality get terms (TERM_NAMESPACES: not the float summaries,
curve statistics or ablation roles, which the refresh rewrites), and only terms of at most
TERM_MAX_BYTES (a GIN entry holds ~2,700). Postgres keeps the table itself: triggers on
runfield (migration 0017) write it in the same statements as the fields, so every path that
writes fields (ingest, COPY, updates, deletes, a store copy) keeps it exact. SQLite has no
such table: its planner drives from the smallest test's range (kb.query_sql.choose_driver).
"""
from __future__ import annotations

import struct

from sqlalchemy import Column, MetaData, Table, Text
from sqlalchemy.dialects.postgresql import ARRAY

# the namespaces whose fields get terms; migration 0017's triggers spell the same list and the
# same term (tests/test_field_terms.py holds the two spellings equal on real rows)
TERM_NAMESPACES = ("config", "hparams", "scale", "tags", "failure", "anomalies")
TERM_MAX_BYTES = 1000

# outside SQLModel's metadata: no SQLite table, and the schema comparison leaves it out
# (kb.models.on_this_dialect)
RUNTERM = Table("runterm", MetaData(), Column("run_id", Text, primary_key=True),
                Column("terms", ARRAY(Text), nullable=False))
POSTGRES_ONLY_TABLES = frozenset({RUNTERM.name})


def field_term(key: str, vtype: str, num: float | None, text: str | None) -> str | None:
    """The term of one RunField row (key, vtype, num, text), as the trigger writes it; None when
    the row gets none (another namespace, a list, or longer than TERM_MAX_BYTES)."""
    if vtype not in ("n", "s", "b", "z") or key.split(".", 1)[0] not in TERM_NAMESPACES:
        return None
    if vtype == "s":
        value = text
    elif vtype == "z":
        value = ""
    else:
        value = struct.pack(">d", num + 0.0).hex()
    term = f"{vtype}{len(key)}:{key}{value}"
    return term if len(term.encode("utf-8", "surrogatepass")) <= TERM_MAX_BYTES else None

