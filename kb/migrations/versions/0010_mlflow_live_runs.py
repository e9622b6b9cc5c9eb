"""MLflow runs logged live through `kb serve`'s MLflow-compatible endpoints: experiments, open runs
and their metric points, kept in SQL until a run ends and is stored as a native run

Revision ID: 0010
Revises: 0009
"""
import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "mlflowexperiment",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("artifact_location", sa.Text(), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "mlflowrun",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("experiment_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("user_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("status", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("start_time", sa.BigInteger(), nullable=True),
        sa.Column("end_time", sa.BigInteger(), nullable=True),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("stored", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(["experiment_id"], ["mlflowexperiment.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("mlflowrun") as batch_op:
        batch_op.create_index(batch_op.f("ix_mlflowrun_experiment_id"), ["experiment_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_mlflowrun_stored"), ["stored"], unique=False)
    op.create_table(
        "mlflowpoint",
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("run_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("timestamp", sa.BigInteger(), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["mlflowrun.id"]),
        sa.PrimaryKeyConstraint("seq"),
    )
    with op.batch_alter_table("mlflowpoint") as batch_op:
        batch_op.create_index(batch_op.f("ix_mlflowpoint_run_id"), ["run_id"], unique=False)


def downgrade() -> None:
    op.drop_table("mlflowpoint")
    op.drop_table("mlflowrun")
    op.drop_table("mlflowexperiment")
