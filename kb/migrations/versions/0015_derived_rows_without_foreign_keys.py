"""The derived index tables (runfield, ablationsig, ablationrun) without foreign keys

A run's field, bucket and member rows are written by the store alone, in the transaction that
writes the run (runfield) or by the ablation refresh from rows it has just read (ablationsig,
ablationrun); no run is ever deleted. Yet every such row paid for a check of its run: on
Postgres an RI trigger per row, a query each, ~130 a run, and ~23% of a bulk ingest's time at
10,000 runs (1.71 -> 1.32 ms a run, measured). The curves, failures, anomalies and an
ablation's baseline keep theirs: a few rows a run.

Postgres drops the constraints in place. SQLite cannot: each table is rebuilt (a new table
without the foreign key, the rows copied in primary-key order, the old one dropped), which
copies every field row once (opening a store of 10,000 runs took 2.1 s with it).

Revision ID: 0015
Revises: 0014
"""
import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

RUN_FK = "FOREIGN KEY(run_id) REFERENCES run (id) ON DELETE CASCADE"
ABLATION_FK = "FOREIGN KEY(ablation_id) REFERENCES ablation (id) ON DELETE CASCADE"

# SQLite: (columns, primary key, WITHOUT ROWID, foreign keys, indexes) as each table stands at
# 0014; the upgrade writes them without their foreign keys, the downgrade with
TABLES = {
    "runfield": ('run_id VARCHAR NOT NULL, "key" VARCHAR NOT NULL, vtype VARCHAR(1) NOT NULL, num FLOAT, text TEXT',
                 '"key", run_id', True, (RUN_FK,),
                 ('CREATE INDEX ix_runfield_key_num ON runfield ("key", vtype, num)',
                  'CREATE INDEX ix_runfield_key_text ON runfield ("key", vtype, text) WHERE text IS NOT NULL',
                  "CREATE INDEX ix_runfield_run_id ON runfield (run_id)")),
    "ablationsig": ('bucket BIGINT NOT NULL, run_id VARCHAR NOT NULL, slot INTEGER NOT NULL, "key" TEXT NOT NULL',
                    "bucket, run_id, slot", True, (RUN_FK,),
                    ("CREATE INDEX ix_ablationsig_run_id ON ablationsig (run_id)",)),
    "ablationrun": ("run_id VARCHAR NOT NULL, ablation_id VARCHAR NOT NULL",
                    "run_id, ablation_id", False, (RUN_FK, ABLATION_FK),
                    ("CREATE INDEX ix_ablationrun_ablation_id ON ablationrun (ablation_id)",)),
}
POSTGRES_FKS = {"runfield": (("run_id", "run", "id"),), "ablationsig": (("run_id", "run", "id"),),
                "ablationrun": (("run_id", "run", "id"), ("ablation_id", "ablation", "id"))}


def _sqlite_rebuild(table: str, with_fks: bool) -> None:
    columns, primary_key, without_rowid, fks, indexes = TABLES[table]
    names = ", ".join(c.split()[0] for c in columns.split(", "))
    constraints = "".join(f", {fk}" for fk in fks) if with_fks else ""
    op.execute(f"CREATE TABLE {table}_new ({columns}, PRIMARY KEY ({primary_key}){constraints})"
               f"{' WITHOUT ROWID' if without_rowid else ''}")
    op.execute(f"INSERT INTO {table}_new ({names}) SELECT {names} FROM {table} ORDER BY {primary_key}")
    op.execute(f"DROP TABLE {table}")             # its indexes go with it
    op.execute(f"ALTER TABLE {table}_new RENAME TO {table}")
    for create in indexes:
        op.execute(create)


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        for table in TABLES:
            _sqlite_rebuild(table, with_fks=False)
        return
    inspector = sa.inspect(bind)
    for table in POSTGRES_FKS:
        for fk in inspector.get_foreign_keys(table):       # by what it is, whatever it was named
            op.drop_constraint(fk["name"], table, type_="foreignkey")


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        for table in TABLES:
            _sqlite_rebuild(table, with_fks=True)
        return
    for table, fks in POSTGRES_FKS.items():
        for column, parent, key in fks:
            op.create_foreign_key(f"{table}_{column}_fkey", table, parent, [column], [key], ondelete="CASCADE")
