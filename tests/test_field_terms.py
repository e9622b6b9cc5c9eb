"""Postgres's run terms (kb.field_terms, migration 0017): the triggers on runfield write exactly
the terms kb.field_terms spells for each field row, through every way rows are written,
updated and deleted, and the migration fills them in for runs stored before it. SQLite has no
such table. The query side (a plan from the terms gives the reference's answer) is tested
beside the other plans in tests/test_query.py.

    KB_TEST_DATABASE_URL=postgresql://postgres@127.0.0.1/test pytest tests/test_field_terms.py -q
"""
from __future__ import annotations

import pytest
from sqlalchemy import inspect, text

from kb.field_terms import TERM_MAX_BYTES, TERM_NAMESPACES, field_term

# values whose spelling could differ between Python and Postgres: signed zero, the smallest
# subnormal, the largest double, an int past 2**53, a float with no short decimal, bools, null,
# text with the separator characters a term uses, non-ASCII, and strings at and past the limit
EDGE_CONFIG = {
    "zero": 0.0, "neg_zero": -0.0, "tiny": 5e-324, "huge": 1.7976931348623157e308, "big_int": 2**53 + 1,
    "third": 1 / 3, "on": True, "off": False, "nothing": None, "sep": "a:b\x1fc", "ünï": "✓ é",
    'q"uote': "it's", "sp ace": "", "list": [1, 2], "nested": {"deep": {"er": 7}},
}


def _long_strings(key_len: int) -> dict:
    """Two strings under config.long_*: one whose term is exactly TERM_MAX_BYTES, one a byte past."""
    at = TERM_MAX_BYTES - len(f"s{key_len}:") - key_len
    return {"long_at": "x" * at, "long_past": "x" * (at + 1)}


def _need_postgres(engine):
    if engine.dialect.name != "postgresql":
        pytest.skip("Postgres's term index; SQLite drives from the smallest test's range instead")


def _stored_terms(conn) -> dict[str, list[str]]:
    return {r: sorted(t) for r, t in conn.execute(text("SELECT run_id, terms FROM runterm"))}


def _spelled_terms(conn) -> dict[str, list[str]]:
    """Each run's terms as kb.field_terms spells them from its field rows."""
    out: dict[str, list[str]] = {}
    for run_id, key, vtype, num, txt in conn.execute(text("SELECT run_id, key, vtype, num, text FROM runfield")):
        term = field_term(key, vtype, num, txt)
        if term is not None:
            out.setdefault(run_id, []).append(term)
    return {r: sorted(t) for r, t in out.items()}


def assert_terms_follow_fields(engine) -> dict[str, list[str]]:
    with engine.connect() as conn:
        stored, spelled = _stored_terms(conn), _spelled_terms(conn)
    assert stored == spelled
    return stored


def _edge_runs() -> list[dict]:
    config = {**EDGE_CONFIG, **_long_strings(len("config.long_past"))}
    return [{"id": "edge", "project": "p", "config": config, "scale": {"params": 124e6}, "tags": ["baseline"],
             "summary": {"val/loss": 3.25}, "metrics": {"val/loss": [[0, 4.0], [100, 3.25]]}},
            {"id": "plain", "project": "p", "config": {"zero": 0, "on": 1, "sep": "a:b"}},
            {"id": "failed", "project": "p", "config": {"zero": 0.0}, "status": "failed",
             "failure": {"kind": "oom", "step": 10, "message": "CUDA out of memory"}}]


def test_postgres_writes_the_terms_python_spells(kb):
    """Ingested runs: the trigger's terms are kb.field_terms' for every field row, edge values
    included; summary and curve statistics get none, a term past TERM_MAX_BYTES none."""
    _need_postgres(kb.engine)
    kb.ingest_records(_edge_runs(), index=False)
    stored = assert_terms_follow_fields(kb.engine)
    edge = stored["edge"]
    assert {t.split(":", 1)[1].split(".", 1)[0] for t in edge} <= set(TERM_NAMESPACES)
    zero = field_term("config.zero", "n", 0.0, None)
    assert zero in edge and field_term("config.neg_zero", "n", 0.0, None) in edge      # -0 spelled as 0
    assert zero in stored["plain"]                   # the int 0 and the float 0.0 are one number
    assert field_term("config.long_at", "s", None, _long_strings(len("config.long_past"))["long_at"]) in edge
    assert not any("config.long_past" in t for t in edge)
    assert not any(t.split(":", 1)[1].startswith(("summary.", "stats.")) for t in edge)
    assert field_term("failure.kind", "s", None, "oom") in stored["failed"]
    assert "s10:config.sepa:b\x1fc" in edge and "s10:config.sepa:b" in stored["plain"]     # the spelling itself


def test_terms_follow_updates_deletes_and_truncation(kb):
    """A run ingested again with other values, fields updated and deleted by statements of any
    size, and runfield truncated: the terms are recomputed with the fields each time."""
    _need_postgres(kb.engine)
    kb.ingest_records(_edge_runs(), index=False)
    changed = {"id": "plain", "project": "p", "config": {"zero": 1, "new_key": "v"}}
    assert kb.ingest_records([changed], index=False).as_dict()["updated"] == 1
    stored = assert_terms_follow_fields(kb.engine)
    assert field_term("config.zero", "n", 0.0, None) not in stored["plain"]
    assert field_term("config.new_key", "s", None, "v") in stored["plain"]
    with kb.engine.begin() as conn:
        conn.execute(text("UPDATE runfield SET num = 42 WHERE key = 'config.zero'"))
        conn.execute(text("UPDATE runfield SET text = 'changed' WHERE key = 'config.sep' AND run_id = 'edge'"))
    stored = assert_terms_follow_fields(kb.engine)
    assert field_term("config.zero", "n", 42.0, None) in stored["failed"]
    with kb.engine.begin() as conn:
        conn.execute(text("DELETE FROM runfield WHERE run_id = 'failed'"))
        conn.execute(text("DELETE FROM runfield WHERE key = 'config.on'"))
    stored = assert_terms_follow_fields(kb.engine)
    assert "failed" not in stored
    with kb.engine.begin() as conn:
        conn.execute(text("TRUNCATE runfield"))
    assert assert_terms_follow_fields(kb.engine) == {}


def test_migration_0017_gives_stored_runs_their_terms(kb):
    """Runs stored before 0017 get their terms when it runs; its downgrade drops the table and
    leaves no trigger behind (a field written at 0016 writes nothing else)."""
    from alembic import command
    from tests.test_migrations import _config
    _need_postgres(kb.engine)
    kb.ingest_records(_edge_runs(), index=False)
    cfg = _config()
    with kb.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0016")
    assert "runterm" not in inspect(kb.engine).get_table_names()
    with kb.engine.begin() as conn:
        conn.execute(text("INSERT INTO runfield (run_id, key, vtype, num) VALUES ('x', 'config.lr', 'n', 0.001)"))
    with kb.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    stored = assert_terms_follow_fields(kb.engine)
    assert stored["x"] == [field_term("config.lr", "n", 0.001, None)]
    assert set(stored) == {"x", "edge", "plain", "failed"}


def test_sqlite_has_no_term_table(engine):
    if engine.dialect.name != "sqlite":
        pytest.skip("the term index is Postgres's")
    assert "runterm" not in inspect(engine).get_table_names()
