"""Postgres: joint statistics on runfield (key, vtype, num)

Without them Postgres multiplies per-column selectivities and guesses that a common value
of one key (lr = 3e-4 in 1,400 of 10,000 runs) matches a dozen rows, and drives the query
from it instead of walking the sort key's index. SQLite has no such statistics; nothing to do.

Revision ID: 0002
Revises: 0001
"""
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("CREATE STATISTICS IF NOT EXISTS runfield_key_num (mcv) ON key, vtype, num FROM runfield")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP STATISTICS IF EXISTS runfield_key_num")
