"""One name for a run's or job's hypothesis: the column `hypothesis_id` becomes `hypothesis`

The record, the JSON shapes and the query language all call it `hypothesis`; the column
now does too. A plain RENAME COLUMN (SQLite >= 3.25, Postgres), not alembic's batch mode:
batch mode rebuilds the table, and dropping `run` with foreign keys on would cascade into
every curve and field row.

Revision ID: 0003
Revises: 0002
"""
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

TABLES = ("run", "job")


def upgrade() -> None:
    for table in TABLES:
        op.execute(f"DROP INDEX IF EXISTS ix_{table}_hypothesis_id")
        op.execute(f"ALTER TABLE {table} RENAME COLUMN hypothesis_id TO hypothesis")
        op.execute(f"CREATE INDEX ix_{table}_hypothesis ON {table} (hypothesis)")


def downgrade() -> None:
    for table in TABLES:
        op.execute(f"DROP INDEX IF EXISTS ix_{table}_hypothesis")
        op.execute(f"ALTER TABLE {table} RENAME COLUMN hypothesis TO hypothesis_id")
        op.execute(f"CREATE INDEX ix_{table}_hypothesis_id ON {table} (hypothesis_id)")
