"""The SQL engine (one per process), sessions, and schema migrations run on open."""
from __future__ import annotations

import fcntl
import logging
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import event, inspect, text
from sqlalchemy.engine import Engine
from sqlmodel import Session, create_engine

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).parent / "migrations"
HEAD = "0003"   # newest revision in migrations/versions; checked without importing alembic


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")       # readers never block the writer
            cur.execute("PRAGMA synchronous=NORMAL")     # durable at checkpoints; WAL keeps it safe
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()
        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://"):]
    return create_engine(url, pool_pre_ping=True)


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        if not inspect(conn).has_table("alembic_version"):
            return None
        return conn.execute(text("select version_num from alembic_version")).scalar()


def migrate(engine: Engine, lock_path: Path | None = None) -> None:
    """Upgrade the schema to HEAD. Cheap when already there: alembic is only imported to upgrade."""
    if current_revision(engine) == HEAD:
        return
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


def session(engine: Engine) -> Session:
    return Session(engine, expire_on_commit=False)
