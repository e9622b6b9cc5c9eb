"""Postgres finds string values through a btree over (key, vtype, text) again, short ones only

The hash index over runfield text (0006) kept every row of one value in one bucket: a value
most runs share (`rmsnorm`, an ablation's role `variant`) made a chain of overflow pages that
each insert walked to its end, so a write got slower as the store grew. In a bulk load of
90,000 runs into 10,000, writing the ablation fields of one 8,000-run project took 4.6 s, of
which 2.9 s were the hash index (1.7 s without it, 2.3 s with this one, measured at 100,000
runs). A btree keeps equal values in order of their rows and deduplicates them.

A btree row holds at most 2,704 bytes, so it indexes the values of at most TEXT_INDEXED bytes
(a key path stays under 1,600, kb.records); a query's string equality says so beside its value
(kb.query_sql.short_text) when the value is that short, so the planner can use the index, and
a longer value is found through its key's rows. `run_id` rides along, as in ix_runfield_key_num,
so a test's range names its runs from the index alone.

Revision ID: 0016
Revises: 0015
"""
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

TEXT_INDEXED = 1000     # bytes, as kb.models.TEXT_INDEXED


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute('CREATE INDEX ix_runfield_key_short_text ON runfield ("key", vtype, text) INCLUDE (run_id) '
                   f"WHERE text IS NOT NULL AND octet_length(text) <= {TEXT_INDEXED}")
        op.execute("DROP INDEX ix_runfield_text_hash")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("CREATE INDEX ix_runfield_text_hash ON runfield USING hash (text) WHERE text IS NOT NULL")
        op.execute("DROP INDEX ix_runfield_key_short_text")
