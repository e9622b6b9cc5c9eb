"""run.name indexed

Runs are looked up by name wherever a person names one: a question that mentions a run
(agents/retrieve.py's link list), a note that names the runs it is about (kb/notes.py), and
`kb show NAME`. Without an index each lookup scanned the run table: at 100,000 runs the link
lookup alone took ~47 ms of a ~75 ms hybrid retrieval on SQLite.

Revision ID: 0013
Revises: 0012
"""
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_run_name", "run", ["name"])


def downgrade() -> None:
    op.drop_index("ix_run_name", table_name="run")
