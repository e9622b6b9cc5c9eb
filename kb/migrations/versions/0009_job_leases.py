"""Jobs are leased: who runs one and until when, its attempts' limit, a cancel flag for a running
job, its stable workdir (checkpoints to resume from), when it started and finished, its progress

The two NOT NULL columns take a server default only while existing rows are filled in, then drop
it: the models declare none, and the schema must match them (tests/test_migrations.py).

Revision ID: 0009
Revises: 0008
"""
import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

NULLABLE = (
    ("worker", sqlmodel.sql.sqltypes.AutoString()),
    ("lease_until", sqlmodel.sql.sqltypes.UTCDateTime()),
    ("heartbeat_at", sqlmodel.sql.sqltypes.UTCDateTime()),
    ("workdir", sa.Text()),
    ("started_at", sqlmodel.sql.sqltypes.UTCDateTime()),
    ("finished_at", sqlmodel.sql.sqltypes.UTCDateTime()),
    ("progress", sa.JSON()),
)
FILLED = (
    ("max_attempts", sa.Integer(), "3"),
    ("cancel_requested", sa.Boolean(), sa.false()),
)


def upgrade() -> None:
    for name, type_ in NULLABLE:
        op.add_column("job", sa.Column(name, type_, nullable=True))
    for name, type_, default in FILLED:
        op.add_column("job", sa.Column(name, type_, nullable=False, server_default=default))
    with op.batch_alter_table("job") as batch_op:
        for name, _, _ in FILLED:
            batch_op.alter_column(name, server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("job") as batch_op:
        for name, *_ in reversed(FILLED + NULLABLE):
            batch_op.drop_column(name)
