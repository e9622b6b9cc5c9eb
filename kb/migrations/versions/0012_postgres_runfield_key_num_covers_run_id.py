"""Postgres: runfield's (key, vtype, num) index carries run_id (INCLUDE)

A test's range in that index gave Postgres the rows' places in the table, and each run id was
then read from the table, a random read per matching row: at 100,000 runs a 10% test (10,000
rows) cost most of a filtered query. With run_id in the index the range is read from the index
alone (an index-only scan once autovacuum has marked the pages visible): the 0.1% and 1%
filters of benchmarks/scale.py went from ~57-67 ms to ~8 ms on the driven plan. SQLite's index
already ends with the primary key (key, run_id); nothing to do there.

Revision ID: 0012
Revises: 0011
"""
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP INDEX IF EXISTS ix_runfield_key_num")
        op.execute("CREATE INDEX ix_runfield_key_num ON runfield (key, vtype, num) INCLUDE (run_id)")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP INDEX IF EXISTS ix_runfield_key_num")
        op.execute("CREATE INDEX ix_runfield_key_num ON runfield (key, vtype, num)")
