"""Migrations and models agree: a database built by the migrations alone has exactly the schema
kb/models.py declares (what `alembic revision --autogenerate` would find to do is nothing), on
SQLite and on Postgres when KB_TEST_DATABASE_URL is set; and kb.db.HEAD names the newest one.

A model change without a migration, or a migration without the bump of kb.db.HEAD (which
`migrate` compares against to skip alembic on open), fails here.

    pytest tests/test_migrations.py -q
"""
from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlmodel import SQLModel

from kb.db import HEAD, MIGRATIONS, current_revision
from kb.models import on_this_dialect  # (importing kb.models registers the tables on SQLModel.metadata)


def schema_diff(conn) -> list:
    # the options kb/migrations/env.py autogenerates with, plus server defaults: none is declared
    # today, so one that appears in a model without a migration is drift too
    context = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True,
                                                     "include_object": on_this_dialect(conn.dialect.name)})
    return compare_metadata(context, SQLModel.metadata)


def test_migrated_schema_matches_the_models(engine):
    with engine.connect() as conn:
        diff = schema_diff(conn)
    assert diff == [], "models and migrations disagree; write a migration for:\n" + "\n".join(map(str, diff))


def test_drift_is_seen_in_this_database(engine):
    # the comparison reads the test's own database (its Postgres schema, not `public`)
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE note ADD COLUMN drift_probe INTEGER"))
    with engine.connect() as conn:
        diff = schema_diff(conn)
    assert [(d[0], d[2], d[3].name) for d in diff] == [("remove_column", "note", "drift_probe")]


def test_head_is_the_newest_migration(engine):
    scripts = ScriptDirectory.from_config(_config())
    assert scripts.get_heads() == [HEAD], f"kb.db.HEAD is {HEAD!r}; migrations end at {scripts.get_heads()}"
    assert current_revision(engine) == HEAD


def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg
