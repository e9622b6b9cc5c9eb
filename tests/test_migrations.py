"""Migrations and models agree: a database built by the migrations alone has exactly the schema
kb/models.py declares (what `alembic revision --autogenerate` would find to do is nothing), on
SQLite and on Postgres when KB_TEST_DATABASE_URL is set; and kb.db.HEAD names the newest one.

A model change without a migration, or a migration without the bump of kb.db.HEAD (which
`migrate` compares against to skip alembic on open), fails here.

    pytest tests/test_migrations.py -q
"""
from __future__ import annotations

import pytest
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


ODD_CURVES = {
    # NaN, ±inf, a null value, an explicit null wall time, two- and three-item points in one curve,
    # a repeated step, the largest step: each reads back as written
    "train/loss": [[0, 10.5, 1700000000.25], [1, float("nan"), 1700000001.0], [2, None, None], [3, float("inf")],
                   [3, -float("inf"), 1700000003.5], [2**63 - 1, 1.0]],
    "lr": [[0, 3e-4], [10, 2.5e-4]],                    # curves come back in the record's order
    "a_first_by_name": [[0, 1.0, None]],
}


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


def _points_equal(got: dict, want: dict) -> bool:
    return list(got) == list(want) and all(
        len(g) == len(w) and all(len(p) == len(q) and all(map(_same, p, q)) for p, q in zip(g, w))
        for g, w in zip(got.values(), want.values()))


def test_curves_survive_migration_0011_both_ways(kb):
    """0011 moved curves from a row per point into packed arrays; its downgrade writes the points
    back as rows and its upgrade packs them again, and the run reads back as logged throughout."""
    from alembic import command
    (run_id,) = kb.ingest_records([{"project": "p", "name": "odd", "metrics": ODD_CURVES}], index=False).ids
    assert _points_equal(kb.run(run_id).metrics, ODD_CURVES)
    cfg = _config()
    with kb.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0010")
        rows = conn.execute(text("select count(*) from metricpoint")).scalar_one()
    assert rows == sum(map(len, ODD_CURVES.values()))
    with kb.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    assert _points_equal(kb.run(run_id).metrics, ODD_CURVES)


def test_postgres_runfield_key_num_index_carries_the_run_id(engine):
    """Migration 0012: a test's range names its runs from the index alone (SQLite's index ends
    with the primary key already)."""
    if engine.dialect.name != "postgresql":
        pytest.skip("Postgres's INCLUDE; SQLite's secondary index holds the primary key")
    with engine.connect() as conn:
        definition = conn.execute(text("SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_runfield_key_num' "
                                       "AND schemaname = current_schema()")).scalar_one()
    assert definition.endswith("(key, vtype, num) INCLUDE (run_id)")


DERIVED = ("runfield", "ablationsig", "ablationrun")


def _derived_state(conn) -> dict:
    from sqlalchemy import inspect
    rows = {t: sorted(map(tuple, conn.execute(text(f"select * from {t}")))) for t in DERIVED}
    fks = {t: sorted(fk["referred_table"] for fk in inspect(conn).get_foreign_keys(t)) for t in DERIVED}
    return {"rows": rows, "fks": fks}


def test_derived_rows_survive_migration_0015_both_ways(kb):
    """0015 dropped the foreign keys of runfield, ablationsig and ablationrun (SQLite rebuilds the
    tables): every row stays through the downgrade and the upgrade, the keys come and go, and a
    query and an ablation refresh still work on the result."""
    from alembic import command
    runs = [{"project": "p", "name": f"lr{lr}-s{seed}", "config": {"lr": lr, "seed": seed},
             "metrics": {"val/loss": [[0, 4.0], [100, 3.0 + lr * 100 + seed / 100]]}}
            for lr in (1e-3, 3e-3) for seed in (0, 1)]
    kb.ingest_records(runs, index=False)
    with kb.engine.connect() as conn:
        before = _derived_state(conn)
    assert all(before["rows"].values()) and before["fks"] == {t: [] for t in DERIVED}
    cfg = _config()
    with kb.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0014")
    with kb.engine.connect() as conn:
        down = _derived_state(conn)
    assert down["rows"] == before["rows"]
    assert down["fks"] == {"runfield": ["run"], "ablationsig": ["run"], "ablationrun": ["ablation", "run"]}
    with kb.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    with kb.engine.connect() as conn:
        assert _derived_state(conn) == before
    assert [r.name for r in kb.runs(where="config.lr = 0.001", sort="summary.val/loss")] == ["lr0.001-s0", "lr0.001-s1"]
    (run_id,) = kb.ingest_records([{"project": "p", "name": "lr0.01-s0", "config": {"lr": 1e-2, "seed": 0},
                                    "metrics": {"val/loss": [[0, 4.0], [100, 4.5]]}}], index=False).ids
    lr = [a for a in kb.run(run_id).ablations if a["factor"] == "config.lr"]
    assert len(lr) == 1 and len(lr[0]["variants"]) == 3     # the seed-0 runs at three lrs
