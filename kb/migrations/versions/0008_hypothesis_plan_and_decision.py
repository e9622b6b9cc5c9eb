"""Hypotheses carry what the proposer and the human gate decide: project, source, goal, a
validation plan, the resolved config's key (so a configuration is proposed once), and who
approved or rejected it, when and why

All nullable: hypotheses written before this have none of it, and nothing is invented for them.

Revision ID: 0008
Revises: 0007
"""
import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

COLUMNS = (
    ("project", sqlmodel.sql.sqltypes.AutoString()),
    ("source", sqlmodel.sql.sqltypes.AutoString()),
    ("goal", sa.Text()),
    ("plan", sa.JSON()),
    ("config_hash", sqlmodel.sql.sqltypes.AutoString()),
    ("decided_by", sqlmodel.sql.sqltypes.AutoString()),
    ("decided_at", sqlmodel.sql.sqltypes.UTCDateTime()),
    ("decision_reason", sa.Text()),
)


def upgrade() -> None:
    # plain ADD COLUMN on both stores (nullable columns need no table copy on SQLite)
    for name, type_ in COLUMNS:
        op.add_column("hypothesis", sa.Column(name, type_, nullable=True))
    op.create_index("ix_hypothesis_project", "hypothesis", ["project"], unique=False)
    op.create_index("ix_hypothesis_config_hash", "hypothesis", ["config_hash"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_hypothesis_config_hash", table_name="hypothesis")
    op.drop_index("ix_hypothesis_project", table_name="hypothesis")
    with op.batch_alter_table("hypothesis") as batch_op:
        for name, _ in reversed(COLUMNS):
            batch_op.drop_column(name)
