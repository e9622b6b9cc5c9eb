"""runfield keyed by (key, run_id), clustered on SQLite; the text index only holds text

A filtered, sorted query drives from one test's rows (`config.optim.lr = 3e-4`: the
(key, vtype, num) index) and probes each run's row of the other keys. With the primary key
(key, run_id), all rows of one key sit together, so those probes read a few hundred pages
instead of one page per run, and on SQLite (WITHOUT ROWID: the table is its primary key)
the (key, vtype, num) index carries run_id, so the driving side never reads the table: the
best-run query at 10,000 runs went from ~10 ms to ~2 ms, whichever lr it asks about. An
index on run_id keeps per-run deletes (re-ingest, cascades) direct.

Most leaves are numbers, and the (key, vtype, text) index only serves string tests, which
never match a NULL text: indexing only rows with text made each run's write ~30% cheaper.

Revision ID: 0005
Revises: 0004
"""
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

COLUMNS = "run_id, key, vtype, num, text"


def _sqlite_rebuild(primary_key: str, with_rowid: bool, text_where: str) -> None:
    # SQLite cannot change a primary key in place: a new table, the rows copied, the old dropped
    op.execute(f"""CREATE TABLE runfield_new (
        run_id VARCHAR NOT NULL, "key" VARCHAR NOT NULL, vtype VARCHAR(1) NOT NULL, num FLOAT, text TEXT,
        PRIMARY KEY ({primary_key}),
        FOREIGN KEY(run_id) REFERENCES run (id) ON DELETE CASCADE){'' if with_rowid else ' WITHOUT ROWID'}""")
    op.execute(f"INSERT INTO runfield_new ({COLUMNS}) SELECT {COLUMNS} FROM runfield ORDER BY {primary_key}")
    op.execute("DROP TABLE runfield")
    op.execute("ALTER TABLE runfield_new RENAME TO runfield")
    op.execute('CREATE INDEX ix_runfield_key_num ON runfield ("key", vtype, num)')
    op.execute(f'CREATE INDEX ix_runfield_key_text ON runfield ("key", vtype, text){text_where}')


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _sqlite_rebuild('"key", run_id', with_rowid=False, text_where=" WHERE text IS NOT NULL")
        op.execute("CREATE INDEX ix_runfield_run_id ON runfield (run_id)")
        return
    op.execute('ALTER TABLE runfield DROP CONSTRAINT runfield_pkey, ADD PRIMARY KEY ("key", run_id)')
    op.execute("CREATE INDEX ix_runfield_run_id ON runfield (run_id)")
    op.execute("DROP INDEX ix_runfield_key_text")
    op.execute('CREATE INDEX ix_runfield_key_text ON runfield ("key", vtype, text) WHERE text IS NOT NULL')


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _sqlite_rebuild('run_id, "key"', with_rowid=True, text_where="")
        return
    op.execute("DROP INDEX ix_runfield_key_text")
    op.execute('CREATE INDEX ix_runfield_key_text ON runfield ("key", vtype, text)')
    op.execute("DROP INDEX ix_runfield_run_id")
    op.execute('ALTER TABLE runfield DROP CONSTRAINT runfield_pkey, ADD PRIMARY KEY (run_id, "key")')
