"""Curves packed: one metricseries row per curve instead of one metricpoint row per point

A curve is written and read whole (queries go through its statistics in runfield), and a row per
point made most of an ingest's cost. The points move into little-endian arrays (kb.series), in
the record's order of curves (the run's stats JSON keeps it); NaN, null values and two-item
points read back as they did.

Revision ID: 0011
Revises: 0010
"""
import math

import sqlalchemy as sa
import sqlmodel
from alembic import op

from kb import series

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

NULL_VALUE, NULL_WALL = 1, 2        # metricpoint.nulls bits (migration 0006)
PAGE = 500

_run = sa.table("run", sa.column("id", sa.String), sa.column("stats", sa.JSON))
_point = sa.table("metricpoint", sa.column("run_id", sa.String), sa.column("key", sa.String),
                  sa.column("seq", sa.Integer), sa.column("step", sa.BigInteger), sa.column("value", sa.Float),
                  sa.column("wall_time", sa.Float), sa.column("nulls", sa.SmallInteger))
_series = sa.table("metricseries", sa.column("run_id", sa.String), sa.column("key", sa.String),
                   sa.column("seq", sa.Integer), sa.column("points", sa.Integer),
                   sa.column("step_bytes", sa.LargeBinary), sa.column("value_bytes", sa.LargeBinary),
                   sa.column("wall_bytes", sa.LargeBinary), sa.column("flag_bytes", sa.LargeBinary))


def upgrade() -> None:
    op.create_table(
        "metricseries",
        sa.Column("run_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("key", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("points", sa.Integer(), nullable=False),
        sa.Column("step_bytes", sa.LargeBinary(), nullable=False),
        sa.Column("value_bytes", sa.LargeBinary(), nullable=False),
        sa.Column("wall_bytes", sa.LargeBinary(), nullable=True),
        sa.Column("flag_bytes", sa.LargeBinary(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["run.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "key"),
        sqlite_with_rowid=False,
    )
    conn = op.get_bind()
    for page in _pages(conn):
        rows = []
        for run_id, stats in page:
            curves: dict[str, list[list]] = {}
            for key, step, value, wall, nulls in conn.execute(
                    sa.select(_point.c.key, _point.c.step, _point.c.value, _point.c.wall_time, _point.c.nulls)
                    .where(_point.c.run_id == run_id).order_by(_point.c.key, _point.c.seq)):
                nulls = nulls or 0
                point = [step, value if value is not None or nulls & NULL_VALUE else math.nan]
                if wall is not None or nulls & NULL_WALL:
                    point.append(wall)
                curves.setdefault(key, []).append(point)
            order = [k for k in (stats or {}) if k in curves] + [k for k in curves if k not in (stats or {})]
            rows += [{"run_id": run_id, "key": key, "seq": i, **series.pack(curves[key])._asdict()}
                     for i, key in enumerate(order)]
        if rows:
            conn.execute(_series.insert(), rows)
    op.drop_table("metricpoint")


def downgrade() -> None:
    op.create_table(
        "metricpoint",
        sa.Column("run_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("key", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("wall_time", sa.Float(), nullable=True),
        sa.Column("nulls", sa.SmallInteger(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["run.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "key", "seq"),
        sqlite_with_rowid=False,
    )
    conn = op.get_bind()
    for page in _pages(conn):
        rows = []
        for run_id, _ in page:
            for key, *packed in conn.execute(
                    sa.select(_series.c.key, _series.c.step_bytes, _series.c.value_bytes, _series.c.wall_bytes,
                              _series.c.flag_bytes).where(_series.c.run_id == run_id)):
                for i, p in enumerate(series.unpack(*packed)):
                    value = p[1]
                    nulls = (NULL_VALUE if value is None else 0) | (NULL_WALL if len(p) > 2 and p[2] is None else 0)
                    rows.append({"run_id": run_id, "key": key, "seq": i, "step": p[0],
                                 "value": None if value is None or value != value else value,
                                 "wall_time": p[2] if len(p) > 2 else None, "nulls": nulls or None})
        if rows:
            conn.execute(_point.insert(), rows)
    op.drop_table("metricseries")


def _pages(conn):
    """(run id, stats) in pages of PAGE runs, by id, so a large store never sits in memory at once."""
    last = None
    while True:
        query = sa.select(_run.c.id, _run.c.stats).order_by(_run.c.id).limit(PAGE)
        if last is not None:
            query = query.where(_run.c.id > last)
        page = conn.execute(query).all()
        if not page:
            return
        yield page
        last = page[-1][0]
