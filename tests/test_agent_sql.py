"""Agent SQL (agents/sql.py) on real SQLite and real Postgres: one SELECT at a time, rows up to a
limit, a timeout, the SQL returned exactly as it ran, and no way to write: each write is tried
through the text check and then straight at the connection, and the store is unchanged after.

    KB_TEST_DATABASE_URL=postgresql://postgres@127.0.0.1/test pytest tests/test_agent_sql.py -q
"""
from __future__ import annotations

import sqlite3

import pytest
from sqlalchemy import func, select, text

from agents.sql import AgentSQLError, ReadOnlySQL, SQLTimeout, UnsafeSQL, check_select, render
from kb.models import Run

RUNS = [{"id": f"r{i}", "project": "p", "config": {"optim": {"lr": lr}}, "summary": {"val/loss": loss}}
        for i, (lr, loss) in enumerate([(1e-4, 3.5), (3e-4, 3.25), (1e-3, 3.4)])]
# a query that runs for minutes unless stopped: a billion-row recursive count
SLOW = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000000000) "
        "SELECT count(*) FROM c")
WRITES = {
    "insert": "INSERT INTO run (id, project) VALUES ('x', 'p')",
    "update": "UPDATE run SET status = 'failed'",
    "delete": "DELETE FROM run",
    "drop": "DROP TABLE runfield",
    "create": "CREATE TABLE evil (x int)",
    "attach": "ATTACH DATABASE '/tmp/kb-evil.sqlite' AS evil",
    "pragma": "PRAGMA query_only = OFF",
    "two statements": "SELECT 1; DELETE FROM run",
    "write in a CTE": "WITH gone AS (DELETE FROM run RETURNING id) SELECT count(*) FROM gone",
    "CTE before a write": "WITH x AS (SELECT 1) DELETE FROM run",
    "select into": "SELECT * INTO evil FROM run",
    "select for update": "SELECT id FROM run FOR UPDATE",
}


@pytest.fixture
def store(kb):
    report = kb.ingest_records(RUNS, index=False)
    assert report.added == len(RUNS)
    return kb


@pytest.fixture
def ro(store):
    with ReadOnlySQL(store.settings.sql_url, timeout_ms=300) as conn:
        yield conn


def state(kb) -> tuple:
    """What a write would change: the runs and their field rows."""
    with kb.engine.connect() as conn:
        runs = conn.execute(select(Run.id, Run.status).order_by(Run.id)).all()
        fields = conn.execute(text("SELECT count(*) FROM runfield")).scalar()
        tables = sorted(conn.dialect.get_table_names(conn))
    return runs, fields, tables


def test_a_select_returns_columns_rows_and_the_sql_as_it_ran(ro):
    result = ro.run("SELECT id, lr FROM run ORDER BY lr DESC;")
    assert result.columns == ["id", "lr"]
    assert result.rows == [("r2", 1e-3), ("r1", 3e-4), ("r0", 1e-4)]
    assert result.sql == "SELECT id, lr FROM run ORDER BY lr DESC" and not result.truncated


def test_a_statement_is_rendered_with_its_literals_and_reruns_as_printed(ro):
    stmt = select(Run.id, Run.lr).where(Run.lr > 2e-4, Run.project == "p", Run.name != "it's").order_by(Run.id)
    result = ro.run(stmt)
    assert "0.0002" in result.sql and "'p'" in result.sql and "'it''s'" in result.sql
    assert ":" not in result.sql.replace("::", "") and "%(" not in result.sql      # no bind markers left
    again = ro.run(result.sql)
    assert again.rows == result.rows == [("r1", 3e-4), ("r2", 1e-3)]


def test_rows_past_the_limit_are_not_fetched(store):
    with ReadOnlySQL(store.settings.sql_url, max_rows=2) as ro:
        result = ro.run("SELECT id FROM run ORDER BY id")
    assert result.rows == [("r0",), ("r1",)] and result.truncated


@pytest.mark.parametrize("name", sorted(WRITES))
def test_the_text_check_refuses_every_write(ro, store, name):
    before = state(store)
    with pytest.raises(UnsafeSQL):
        ro.run(WRITES[name])
    assert state(store) == before


@pytest.mark.parametrize("name", sorted(WRITES))
def test_the_connection_itself_refuses_every_write(ro, store, name):
    # past the text check (its private runner): the database's own read-only mode must hold
    before = state(store)
    with pytest.raises(AgentSQLError):
        ro._execute(WRITES[name])
    assert state(store) == before
    assert ro.run("SELECT count(*) FROM run").rows == [(3,)]        # still usable


@pytest.mark.parametrize("sql", [
    "SELECT pg_read_file('/etc/passwd')", "SELECT set_config('default_transaction_read_only', 'off', false)",
    "SELECT load_extension('/tmp/evil')", "SELECT E'\\'' FROM run", "SELECT $$x$$", "SELECT id FROM run WHERE id = ?",
    "", "   ;", "EXPLAIN SELECT 1", "SELECT 1 /* unterminated", "SELECT 'unterminated",
])
def test_the_text_check_refuses_server_functions_parameters_and_odd_quoting(sql):
    with pytest.raises(UnsafeSQL):
        check_select(sql)


@pytest.mark.parametrize("sql", [
    "SELECT 'delete; drop table run' AS words",
    'SELECT 1 AS "update"',
    "SELECT id FROM run -- ; DELETE FROM run\n",
    "select /* insert */ count(*) from run;",
    "WITH best AS (SELECT id FROM run ORDER BY id LIMIT 1) SELECT * FROM best",
    "SELECT replace(id, 'r', 'R') FROM run",
])
def test_the_text_check_lets_reads_through(ro, sql):
    assert check_select(sql) == sql.strip().rstrip(";").rstrip()
    ro.run(sql)


def test_sqlite_read_only_mode_holds_without_the_authorizer(store):
    """The second wall on its own: with the authorizer and query_only switched off, the file is
    still opened read-only."""
    if store.engine.dialect.name != "sqlite":
        pytest.skip("SQLite's open mode")
    ro = ReadOnlySQL(store.settings.sql_url)
    conn = ro.connection()
    conn.set_authorizer(None)
    conn.execute("PRAGMA query_only = OFF")
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        conn.execute("DELETE FROM run")
    ro.close()
    assert len(state(store)[0]) == 3


def test_postgres_transactions_stay_read_only_after_the_session_default_is_changed(store):
    """Each query runs in its own READ ONLY transaction: changing the session's default (which a
    SELECT can do through set_config, were it let through) does not open a write."""
    if store.engine.dialect.name != "postgresql":
        pytest.skip("Postgres transactions")
    with ReadOnlySQL(store.settings.sql_url) as ro:
        ro._execute("SELECT set_config('default_transaction_read_only', 'off', false)")
        with pytest.raises(AgentSQLError, match="read-only"):
            ro._execute("DELETE FROM run")
    assert len(state(store)[0]) == 3


def test_a_long_query_is_interrupted_by_the_timeout(ro):
    with pytest.raises(SQLTimeout):
        ro.run(SLOW)
    assert ro.run("SELECT count(*) FROM run").rows == [(3,)]       # the connection survives it


def test_a_database_error_is_a_domain_error_that_names_the_problem(ro):
    with pytest.raises(AgentSQLError, match="no_such_table|does not exist"):
        ro.run("SELECT * FROM no_such_table")


def test_render_matches_each_dialect(store):
    stmt = select(func.count()).select_from(Run).where(Run.project == "p")
    for dialect in ("sqlite", "postgresql"):
        assert "'p'" in render(stmt, dialect)


def test_a_store_that_cannot_be_opened_is_a_domain_error(tmp_path):
    with pytest.raises(AgentSQLError, match="read-only"):
        ReadOnlySQL(f"sqlite:///{tmp_path / 'missing.sqlite'}").run("SELECT 1")
    assert not (tmp_path / "missing.sqlite").exists()        # read-only: not even created
