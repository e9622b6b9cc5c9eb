"""Ablation ids that outlive their members

An ablation's id was a digest of its factor and member runs, so every run that joined it (one
more seed, one more learning rate) gave it a new id: a hypothesis, report or answer that cited
it pointed at nothing, and every member's `ablations.<name>.id` field was rewritten. Now
(kb.ablations._build) the id is a digest of the project, factor and bucket.

No table changes: every project is queued for one recomputation from scratch, which renames
its ablations at the next refresh (kb.ablation_store).

Revision ID: 0014
Revises: 0013
"""
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("INSERT INTO ablationpending (project) SELECT DISTINCT project FROM run")


def downgrade() -> None:
    # the old ids come back the same way: a recomputation of every project by the older code
    op.execute("INSERT INTO ablationpending (project) SELECT DISTINCT project FROM run")
