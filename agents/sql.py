"""The agent's SQL: a connection to the store that can only read, one SELECT at a time.

Everything an agent computes from the store (the planner's answers, text-to-SQL from a capable
LLM) runs here, behind three walls, so that no question, and no instruction hidden in an
ingested note, can change the store:

1. the text is checked before it runs: one statement, SELECT or WITH, no write keyword
   anywhere (a DELETE hidden in a CTE included), no server-side functions (`pg_*`, `lo_*`,
   dblink, set_config, load_extension, ...);
2. the connection cannot write: SQLite is opened `mode=ro` with `query_only` on and an
   authorizer that allows reads only; Postgres runs each query in a `READ ONLY` transaction
   (and `default_transaction_read_only` for anything else on the session);
3. nothing is ever committed: a Postgres query's transaction is always rolled back.

Each query has a row limit (rows past it are not fetched) and a timeout on both databases
(SQLite: a progress handler that interrupts; Postgres: `statement_timeout`). The result keeps
the exact text that ran, with every literal in place, so an answer can show runnable SQL:

    with ReadOnlySQL(kb.settings.sql_url) as ro:
        result = ro.run("SELECT id, lr FROM run WHERE status = 'diverged'")
        result.sql, result.columns, result.rows, result.truncated
"""
from __future__ import annotations

import math
import re
import sqlite3
import time
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any
from urllib.request import pathname2url

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.sql import ClauseElement

from kb.errors import KBError

MAX_ROWS = 1000
TIMEOUT_MS = 5000


class AgentSQLError(KBError):
    """The database refused or failed an agent query (a syntax error, a denied write)."""


class UnsafeSQL(AgentSQLError):
    """Rejected before running: not exactly one read-only SELECT."""


class SQLTimeout(AgentSQLError):
    """The query ran past its time limit and was interrupted."""


@dataclass
class SQLResult:
    sql: str                       # exactly what ran, literals in place
    columns: list[str]
    rows: list[tuple]
    truncated: bool = False        # more rows existed past the row limit
    elapsed_ms: float = 0.0
    dialect: str = field(default="sqlite", repr=False)

    def dicts(self) -> list[dict]:
        return [dict(zip(self.columns, row)) for row in self.rows]


# ---- the text check --------------------------------------------------------------------------

# what writes inside one statement (a data-modifying CTE, SELECT INTO, FOR UPDATE) and what
# starts a statement that writes or changes the session (a second statement is refused anyway:
# this keeps one that slipped past the ';' check from running); words only a statement could
# start with and that people use as aliases (start, comment, load, ...) are left alone
DENIED_WORDS = frozenset("""
    insert update delete merge upsert into returning conflict drop alter create attach detach
    pragma truncate grant revoke vacuum reindex analyze copy set begin commit rollback savepoint
    explain lock
""".split())
# functions with side effects or that reach the server (its files, its sessions, other
# databases): refused by name, since the store's role may be a superuser
DENIED_FUNCTIONS = frozenset("""
    set_config nextval setval currval lastval txid_current load_extension readfile writefile edit
    fts3_tokenizer query_to_xml query_to_xmlschema query_to_xml_and_xmlschema cursor_to_xml
    table_to_xml schema_to_xml database_to_xml
""".split())
DENIED_PREFIXES = ("pg_", "lo_", "dblink")
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")
CALL = re.compile(r"\s*\(")
CLOSERS = {"'": "'", '"': '"', "`": "`", "[": "]"}


def check_select(sql: str) -> str:
    """The statement without a trailing `;`, or UnsafeSQL saying what is wrong.

    A small lexer, not a parser: strings, quoted identifiers and comments are skipped, every
    word outside them is checked. It errs on the side of refusing (a comment Postgres would
    nest ends early here, so more text gets checked, never less)."""
    text = sql.strip()
    if not text:
        raise UnsafeSQL("empty query")
    if "\x00" in text:
        raise UnsafeSQL("the query contains a NUL character")
    words: list[str] = []
    i, n, end = 0, len(text), len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif text.startswith("--", i):
            j = text.find("\n", i)
            i = n if j < 0 else j + 1
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise UnsafeSQL("unterminated /* comment")
            i = j + 2
        elif c in CLOSERS:
            if c == "'" and i and (text[i - 1].isalnum() or text[i - 1] in "_&"):
                # E'..', U&'..', X'..': backslash escapes would end the string elsewhere than here
                raise UnsafeSQL(f"prefixed string literal at character {i}: use a plain '...' string")
            i = _skip_quoted(text, i, CLOSERS[c])
        elif c == ";":
            if text[i + 1:].strip(" \t\r\n;"):
                raise UnsafeSQL("one statement only: the query has text after ';'")
            end = i
            break
        elif c in "$?":
            raise UnsafeSQL(f"{c!r} at character {i}: no parameters or dollar quoting; write literals inline")
        elif m := WORD.match(text, i):
            word = m.group().lower()
            words.append(word)
            called = CALL.match(text, m.end()) is not None
            if word in DENIED_WORDS:
                raise UnsafeSQL(f"{m.group().upper()} is not allowed: agent SQL only reads (one SELECT)")
            if word.startswith(DENIED_PREFIXES) or (called and word in DENIED_FUNCTIONS):
                raise UnsafeSQL(f"{m.group()} is not allowed in agent SQL")
            i = m.end()
        else:
            i += 1
    if not words or words[0] not in ("select", "with"):
        raise UnsafeSQL("agent SQL must start with SELECT or WITH")
    return text[:end].rstrip()


def _skip_quoted(text: str, i: int, closer: str) -> int:
    """The index after the quoted run starting at i; a doubled closer is an escaped one."""
    j = i + 1
    while True:
        k = text.find(closer, j)
        if k < 0:
            raise UnsafeSQL(f"unterminated {text[i]} at character {i}")
        if closer != "]" and text.startswith(closer * 2, k):
            j = k + 2
            continue
        return k + 1


# ---- running ---------------------------------------------------------------------------------

def render(stmt: ClauseElement, dialect: str) -> str:
    """A SQLAlchemy statement as text with its literals inline: what runs is what is shown."""
    d = sqlite.dialect() if dialect == "sqlite" else postgresql.dialect()
    return str(stmt.compile(dialect=d, compile_kwargs={"literal_binds": True}))


class ReadOnlySQL:
    """Read-only queries on the store at `url` (a SQLAlchemy URL: sqlite:///..., postgresql://...)."""

    def __init__(self, url: str, *, max_rows: int = MAX_ROWS, timeout_ms: int = TIMEOUT_MS):
        self.url = make_url(url)
        backend = self.url.get_backend_name()
        if backend not in ("sqlite", "postgresql"):
            raise AgentSQLError(f"unsupported database {backend!r}; known: postgresql, sqlite")
        self.dialect = backend
        self.max_rows, self.timeout_ms = max_rows, timeout_ms
        self._conn = None
        self._deadline = math.inf       # set for each query; none outside one

    def __enter__(self) -> "ReadOnlySQL":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def run(self, query: str | ClauseElement) -> SQLResult:
        """Check, run and fetch one SELECT (text, or a SQLAlchemy statement rendered with its
        literals), at most max_rows rows."""
        sql = check_select(query if isinstance(query, str) else render(query, self.dialect))
        return self._execute(sql)

    def connection(self):
        """The DBAPI connection, opened once, already read-only with its limits set."""
        if self._conn is None:
            self._conn = self._open_sqlite() if self.dialect == "sqlite" else self._open_postgres()
        return self._conn

    def _execute(self, sql: str) -> SQLResult:
        """Run sql as is, without the text check: the connection's own walls still hold (the
        tests use this to show that they do)."""
        conn, started = self.connection(), time.monotonic()
        if self.dialect == "sqlite":
            columns, rows, truncated = self._fetch_sqlite(conn, sql)
        else:
            columns, rows, truncated = self._fetch_postgres(conn, sql)
        return SQLResult(sql, columns, [tuple(map(_plain, r)) for r in rows], truncated,
                         (time.monotonic() - started) * 1000, self.dialect)

    # SQLite -------------------------------------------------------------------------------

    def _open_sqlite(self) -> sqlite3.Connection:
        path = self.url.database
        if not path or path == ":memory:":
            raise AgentSQLError("agent SQL needs a database file (an in-memory SQLite has nothing to read)")
        try:
            conn = sqlite3.connect(f"file:{pathname2url(path)}?mode=ro", uri=True, isolation_level=None,
                                   check_same_thread=False)
        except sqlite3.Error as exc:
            raise AgentSQLError(f"cannot open {path} read-only: {exc}") from None
        conn.execute("PRAGMA query_only = ON")
        conn.set_authorizer(_sqlite_authorizer)
        # every 1,000 VM instructions: cheap next to the query, fine-grained enough to stop on time
        conn.set_progress_handler(lambda: int(time.monotonic() > self._deadline), 1000)
        return conn

    def _fetch_sqlite(self, conn: sqlite3.Connection, sql: str):
        self._deadline = time.monotonic() + self.timeout_ms / 1000
        try:
            cur = conn.execute(sql)
            rows = cur.fetchmany(self.max_rows + 1)
            columns = [d[0] for d in cur.description or ()]
            cur.close()
        except sqlite3.OperationalError as exc:
            if "interrupt" in str(exc):
                raise SQLTimeout(f"query interrupted after {self.timeout_ms} ms") from None
            raise AgentSQLError(f"the database refused the query: {exc}") from None
        except (sqlite3.DatabaseError, sqlite3.Warning, sqlite3.ProgrammingError) as exc:
            raise AgentSQLError(f"the database refused the query: {exc}") from None
        finally:
            self._deadline = math.inf
        return columns, rows[:self.max_rows], len(rows) > self.max_rows

    # Postgres -----------------------------------------------------------------------------

    def _open_postgres(self):
        import psycopg

        conninfo = self.url.set(drivername="postgresql").render_as_string(hide_password=False)
        try:
            conn = psycopg.connect(conninfo, autocommit=True, connect_timeout=10)
        except psycopg.Error as exc:
            raise AgentSQLError(f"cannot connect to {self.url.render_as_string()}: {str(exc).strip()}") from None
        # the session default too, so even a statement that escaped the BEGIN below reads only
        conn.execute("SET default_transaction_read_only = on")
        conn.execute(f"SET statement_timeout = {int(self.timeout_ms)}")
        conn.execute(f"SET lock_timeout = {int(self.timeout_ms)}")
        return conn

    def _fetch_postgres(self, conn, sql: str):
        import psycopg

        try:
            conn.execute("BEGIN TRANSACTION READ ONLY")
            try:
                # prepared (the extended protocol): Postgres itself refuses a second statement,
                # which a plain execute would run (`select 1; commit; ...`)
                cur = conn.execute(sql, prepare=True)
                rows = cur.fetchmany(self.max_rows + 1) if cur.description else []
                columns = [d.name for d in cur.description or ()]
            finally:
                conn.execute("ROLLBACK")       # nothing an agent ran is ever committed
        except psycopg.errors.QueryCanceled:
            raise SQLTimeout(f"query cancelled after {self.timeout_ms} ms (statement_timeout)") from None
        except psycopg.OperationalError as exc:
            self.close()                       # a broken connection: the next query reconnects
            raise AgentSQLError(f"the database connection failed: {exc}") from None
        except psycopg.Error as exc:
            raise AgentSQLError(f"the database refused the query: {str(exc).strip()}") from None
        return columns, rows[:self.max_rows], len(rows) > self.max_rows


_SQLITE_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE}


def _sqlite_authorizer(action: int, arg1, arg2, _db, _trigger) -> int:
    """SQLite asks before each operation a statement compiles to: reads only."""
    if action in _SQLITE_ALLOWED:
        return sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_FUNCTION:
        name = (arg2 or "").lower()
        denied = name in DENIED_FUNCTIONS or name.startswith(DENIED_PREFIXES)
        return sqlite3.SQLITE_DENY if denied else sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


def _plain(value: Any) -> Any:
    """Postgres returns numeric aggregates (avg of a bigint) as Decimal: a JSON number instead."""
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    return value
