"""Long strings on Postgres (a hash index over runfield text) and curve nulls kept apart from NaN

runfield: Postgres refuses a btree row over 2,704 bytes, so the (key, vtype, text) index made a
1 MB config string, or a few KB of incompressible text, fail the whole run. Postgres finds text
by a hash index instead (no size limit; equality is what it serves, and string order there is
COLLATE "C", which the old index never served). SQLite keeps its btree: it has no such limit.

metricpoint.nulls: SQLite stores a NaN as NULL, so a NULL value has meant NaN; a null value (no
value) and a point written with a null wall time read back as NaN and as a two-item point.
The new column marks those (1: the value is null, 2: the wall time is null); NULL for every
other point, so the rows already stored keep their meaning.

Revision ID: 0006
Revises: 0005
"""
import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("metricpoint", sa.Column("nulls", sa.SmallInteger(), nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP INDEX ix_runfield_key_text")
        op.execute("CREATE INDEX ix_runfield_text_hash ON runfield USING hash (text) WHERE text IS NOT NULL")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP INDEX ix_runfield_text_hash")
        op.execute('CREATE INDEX ix_runfield_key_text ON runfield ("key", vtype, text) WHERE text IS NOT NULL')
    op.drop_column("metricpoint", "nulls")        # SQLite drops a column in place since 3.35
