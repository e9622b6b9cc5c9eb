"""Ablations refreshed incrementally: bucket rows, ablation members, a refresh queue

Every ingest recomputed its project's ablations whole, comparing every config with every
other one key at a time (quadratic in config size: 20,000 keys took minutes), and two
writers refreshing one project at once on Postgres collided on the ablation primary key.
Now (kb.ablation_store) a run's buckets are hashed into ablationsig and looked up, each
ablation's runs are listed in ablationrun (so a changed run's old ablations are found), and
writers queue their runs in ablationpending, which one refresh at a time drains.

Existing ablations stay as they are until then: every project is queued for one
recomputation from scratch, which fills the new tables at the next refresh.

Revision ID: 0007
Revises: 0006
"""
import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ablation") as batch_op:
        batch_op.add_column(sa.Column("bucket", sa.BigInteger(), nullable=True))
        batch_op.create_index("ix_ablation_bucket", ["bucket"], unique=False)
    op.create_table(
        "ablationsig",
        sa.Column("bucket", sa.BigInteger(), nullable=False),
        sa.Column("run_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("slot", sa.Integer(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["run.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("bucket", "run_id", "slot"),
        sqlite_with_rowid=False,
    )
    op.create_index("ix_ablationsig_run_id", "ablationsig", ["run_id"], unique=False)
    op.create_table(
        "ablationrun",
        sa.Column("run_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("ablation_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["run.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["ablation_id"], ["ablation.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "ablation_id"),
    )
    op.create_index("ix_ablationrun_ablation_id", "ablationrun", ["ablation_id"], unique=False)
    op.create_table(
        "ablationpending",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("project", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.execute("INSERT INTO ablationpending (project) SELECT DISTINCT project FROM run")


def downgrade() -> None:
    op.drop_table("ablationpending")
    op.drop_index("ix_ablationrun_ablation_id", table_name="ablationrun")
    op.drop_table("ablationrun")
    op.drop_index("ix_ablationsig_run_id", table_name="ablationsig")
    op.drop_table("ablationsig")
    with op.batch_alter_table("ablation") as batch_op:
        batch_op.drop_index("ix_ablation_bucket")
        batch_op.drop_column("bucket")
