"""The SQL engine (one per process), sessions, and schema migrations run on open.

A SQLite file this process may not write (a shared knowledge base on a read-only mount, or
files of another user) is opened read-only: reads work, a write raises ReadOnlyStore.
"""
from __future__ import annotations

import fcntl
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator
from urllib.parse import quote, unquote

from sqlalchemy import event, inspect, make_url, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlmodel import Session, create_engine

from kb.errors import ReadOnlyStore

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).parent / "migrations"
HEAD = "0018"   # newest revision in migrations/versions; checked without importing alembic


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = _sqlite_file(url)
        read_only = path is not None and not _writable(path)
        if read_only:
            url = _read_only_url(path)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "handle_error")
        def _sqlite_read_only(context):
            if "readonly database" in str(context.original_exception):
                raise ReadOnlyStore(f"knowledge base at {path or url} is read-only") from context.original_exception

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):
            cur = dbapi_conn.cursor()
            if read_only:
                cur.execute("PRAGMA query_only=ON")
            else:
                cur.execute("PRAGMA journal_mode=WAL")   # readers never block the writer
            cur.execute("PRAGMA synchronous=NORMAL")     # durable at checkpoints; WAL keeps it safe
            cur.execute("PRAGMA foreign_keys=ON")
            # a savepoint keeps the original of each page it changes that the transaction had
            # already changed (so ROLLBACK TO can restore it): in memory, not a temp file per
            # run of a WriteBatch (runfield inserts ~20% faster)
            cur.execute("PRAGMA temp_store=MEMORY")
            # a bulk load's transaction fits its pages (the default 2 MB spilled them to the WAL
            # before the commit: a 2,000-run load cost the writer ~10% more CPU); lazily allocated
            cur.execute("PRAGMA cache_size=-65536")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn):
            # a WriteBatch connection runs with the driver's own transaction handling off (its
            # BEGIN/SAVEPOINT emulation would commit at the first RELEASE), so it begins here;
            # IMMEDIATE takes the write lock up front, so its read-then-write never meets a
            # snapshot another writer has moved on from (which fails at once, no busy wait)
            if conn.get_execution_options().get("kb_write_batch"):
                conn.exec_driver_sql("BEGIN IMMEDIATE")
        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://"):]
    engine = create_engine(url, pool_pre_ping=True)

    @event.listens_for(engine, "do_connect")
    def _postgres_no_jit(_dialect, _record, _cargs, cparams):
        # JIT compiles a query's expressions once its estimated cost passes 100,000: a --where of
        # 2,000 terms spent 37 s compiling for a 1 s plan; queries here are short and never gain
        cparams["options"] = f"{cparams.get('options', '')} -c jit=off".strip()
    return engine


def is_read_only(engine: Engine) -> bool:
    return engine.dialect.name == "sqlite" and engine.url.query.get("mode") == "ro"


def _sqlite_file(url: str) -> Path | None:
    database = make_url(url).database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None                  # in memory, or a URI whose options the caller chose
    return Path(database)


def _writable(path: Path) -> bool:
    """Whether SQLite can write here: the file, and its folder for the -wal and -shm files. A file
    not made yet is left to fail (or be created) as usual."""
    if not path.exists():
        return True
    return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)


def _read_only_url(path: Path) -> str:
    """A read-only WAL database needs its -shm file: SQLite cannot make one in a folder it may not
    write. With no -wal (a clean close checkpoints and removes it) every change is in the main
    file, and `immutable=1` reads it without -shm or locks. With a -wal, a -shm beside it (a
    writer is, or was, running) lets `mode=ro` read the changes the -wal holds."""
    wal, shm = Path(f"{path}-wal"), Path(f"{path}-shm")
    pending = wal.exists() and wal.stat().st_size > 0
    if pending and not shm.exists():
        raise ReadOnlyStore(f"knowledge base at {path} is read-only, and its latest changes are in "
                            f"{wal.name} with no {shm.name} to read them by: open it once where it is "
                            "writable (any kb command does), or copy the folder somewhere writable")
    options = "mode=ro" if pending else "mode=ro&immutable=1"
    return f"sqlite:///file:{quote(str(path.resolve()))}?{options}&uri=true"


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        if not inspect(conn).has_table("alembic_version"):
            return None
        return conn.execute(text("select version_num from alembic_version")).scalar()


def migrate(engine: Engine, lock_path: Path | None = None) -> None:
    """Upgrade the schema to HEAD. Cheap when already there: alembic is only imported to upgrade."""
    revision = current_revision(engine)
    if revision == HEAD:
        return
    if is_read_only(engine):
        where = unquote(engine.url.database.removeprefix("file:"))
        raise ReadOnlyStore(f"knowledge base at {where} is read-only and its schema is at "
                            f"{revision or 'nothing'}, not {HEAD}: run any kb command on it once where it is writable")
    with _migration_lock(engine, lock_path):
        if current_revision(engine) == HEAD:      # another process did it while we waited
            return
        from alembic import command
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS))
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
        log.info("schema upgraded to %s", HEAD)


@contextmanager
def _migration_lock(engine: Engine, lock_path: Path | None):
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            conn.execute(text("select pg_advisory_lock(7243001)"))
            try:
                yield
            finally:
                conn.execute(text("select pg_advisory_unlock(7243001)"))
                conn.commit()
        return
    if lock_path is None:
        yield
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


IN_CHUNK = 500      # ids per IN list: Postgres takes 65,535 parameters, an old SQLite 999


def chunked(items: Iterable) -> Iterator[list]:
    """Items in lists of IN_CHUNK, for `IN (...)` lists of any length on both databases."""
    items = list(items)
    for i in range(0, len(items), IN_CHUNK):
        yield items[i:i + IN_CHUNK]


def bulk_insert(conn, table: str, columns: tuple[str, ...], rows: list[tuple]) -> None:
    """Rows straight to the driver, in the caller's transaction: SQLAlchemy's per-row parameter
    handling cost more than the inserts. On Postgres through COPY: psycopg's executemany still
    sends a statement per row (a run has ~100 field rows), and that was most of an ingest."""
    if not rows:
        return
    cols = ", ".join(f'"{c}"' for c in columns)
    if conn.dialect.name == "postgresql":
        sql = f"COPY {table} ({cols}) FROM STDIN"
        try:
            with conn.connection.cursor() as cur, cur.copy(sql) as copy:
                for row in rows:
                    copy.write_row(row)
        except conn.dialect.dbapi.Error as exc:
            # the driver's own error, past SQLAlchemy: raised as SQLAlchemy's, as any statement's is
            # (a duplicate key is an IntegrityError to the writer whichever way it went in)
            raise DBAPIError.instance(sql, None, exc, conn.dialect.dbapi.Error, dialect=conn.dialect) from None
        return
    conn.exec_driver_sql(f"INSERT INTO {table} ({cols}) VALUES ({', '.join(['?'] * len(columns))})", rows)


def insert_dicts(conn, table, rows: list[dict]) -> None:
    """Rows given as dicts alike in their keys, through bulk_insert: each value converted as
    SQLAlchemy would bind it (JSON serialized, datetimes in SQLite's text form), without its
    per-row statement handling, which cost more than the rows (a run row has 8 JSON columns; an
    executemany of them took ~40% of a Postgres writer thread's samples, and 0.07 ms of CPU a
    run against 0.05 this way). Column defaults are not applied: every column a row leaves out
    must have none or a server one."""
    if not rows:
        return
    columns = tuple(rows[0])
    dialect = conn.dialect
    convert = [(table.c[c].type.dialect_impl(dialect).bind_processor(dialect), c) for c in columns]
    bulk_insert(conn, table.name, columns,
                [tuple(row[c] if f is None else f(row[c]) for f, c in convert) for row in rows])


# tables whose index-only scans `kb runs` reads: vacuumed after every bulk load, so their new
# pages are all-visible (else each index entry reads the table: 71 ms against 18 ms at 100,000 runs);
# and runterm, whose GIN index keeps new entries in a list every search reads until a vacuum
# merges them (kb.field_terms)
VACUUMED = ("runfield", "run", "runterm")
# tables analyzed after a bulk load that grew the store by ANALYZE_GROWTH or more (autovacuum's
# default scale factor): the ablation refresh's lookups need their statistics as much as queries
ANALYZED = ("runfield", "run", "runterm", "ablationsig", "ablationrun", "ablation", "metricseries")
ANALYZE_GROWTH = 0.1


def maintain_after_bulk_load(engine: Engine, runs_written: int) -> list[str]:
    """Postgres, after an ingest of many runs, in case autovacuum is off or behind: VACUUM the
    VACUUMED tables (cheap: only the new pages are visited) and ANALYZE every ANALYZED table once
    the load is a tenth of the store. Analyzing after every batch cost more than the vacuum (a
    random sample of each table: 0.4 s a batch at 40,000 runs). Returns the statements run."""
    if engine.dialect.name != "postgresql":
        return []
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:    # VACUUM: no transaction
        known = conn.execute(text("SELECT reltuples FROM pg_class WHERE oid = to_regclass('run')")).scalar()
        # reltuples is -1 before the first ANALYZE; it counts the store as of the last one
        analyze = known is None or known < 0 or runs_written >= ANALYZE_GROWTH * max(known, 1)
        done = []
        for table in dict.fromkeys(VACUUMED + (ANALYZED if analyze else ())):
            options = [o for o, on in (("VACUUM", table in VACUUMED), ("ANALYZE", analyze and table in ANALYZED)) if on]
            sql = (f"VACUUM (ANALYZE) {table}" if len(options) == 2 else f"{options[0]} {table}")
            conn.execute(text(sql))
            done.append(sql)
        return done


def session(engine: Engine) -> Session:
    return Session(engine, expire_on_commit=False)


class WriteBatch:
    """Many records written in one transaction, each in its own SAVEPOINT.

        with WriteBatch(engine) as batch:
            for record in records:
                with batch.record() as s:      # one record: all of its rows, or none of them
                    write_run(s, record, ...)

    A record that raises rolls back to its savepoint alone; the records before it stay. The
    transaction commits every BATCH_RECORDS records or BATCH_SECONDS (a commit per run cost
    more than its inserts: every index page a run touched went to the WAL again; and a long
    ingest must not hold SQLite's write lock for long), at the end, and also when an exception
    ends the batch early, so what was written before it is kept.
    """
    BATCH_RECORDS = 500
    BATCH_SECONDS = 1.0

    def __init__(self, engine: Engine):
        options = {"isolation_level": "AUTOCOMMIT", "kb_write_batch": True} if engine.dialect.name == "sqlite" else {}
        self.conn = engine.connect().execution_options(**options)
        self.session = Session(self.conn, expire_on_commit=False)
        self.pending, self.since = 0, time.monotonic()

    def __enter__(self) -> "WriteBatch":
        return self

    @contextmanager
    def record(self, count: int = 1):
        """One record's writes (or `count` records written together), all or nothing."""
        with self.session.begin_nested():          # SAVEPOINT ... RELEASE, or ROLLBACK TO on error
            yield self.session
        self.pending += count
        if self.pending >= self.BATCH_RECORDS or time.monotonic() - self.since > self.BATCH_SECONDS:
            self.commit()

    def commit(self) -> None:
        if self.session.in_transaction():
            self.session.commit()
        self.pending, self.since = 0, time.monotonic()

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.commit()
            else:
                try:
                    self.commit()                  # the records before the failure stay
                except Exception:                  # the connection itself failed: the error above says why
                    log.exception("could not commit the records written before an error")
                    self.session.rollback()
        finally:
            self.session.close()
            self.conn.close()
