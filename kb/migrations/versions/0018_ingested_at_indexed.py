"""ingested_at indexed on run, note and ablation

The keyword index checks before every question whether SQL changed since it was built
(agents.sparse.signature: each table's count and newest write). Without an index the newest
`ingested_at` was a scan: at 100,000 runs on SQLite 95 ms for runs and 39 ms for ablations, on
every question. `kb runs --sort ingested_at` and the failure list (newest runs first) read the
same order.

Revision ID: 0018
Revises: 0017
"""
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

TABLES = ("run", "note", "ablation")


def upgrade() -> None:
    for table in TABLES:
        op.create_index(f"ix_{table}_ingested_at", table, ["ingested_at"])


def downgrade() -> None:
    for table in TABLES:
        op.drop_index(f"ix_{table}_ingested_at", table_name=table)
