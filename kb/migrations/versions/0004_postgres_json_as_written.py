"""Postgres: JSON columns keep the text they were given (json, not jsonb)

jsonb normalises what it stores: keys are reordered and a number is kept as the numeric it
equals, so a config read back from Postgres differed from the same config read back from
SQLite (key order; 1.9e18 came back as the integer 1900000000000000000). Nothing queries
inside these columns (queries go through the typed runfield rows), so plain json, which
stores the text as written, costs nothing and makes both stores read back alike. SQLite
already stores the text; nothing to do there.

Revision ID: 0004
Revises: 0003
"""
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

COLUMNS = {
    "run": ("config", "scale", "summary", "stats", "tags", "code", "meta"),
    "note": ("mentions",),
    "ablation": ("variants", "effect"),
    "hypothesis": ("change", "evidence", "predicted", "risks", "result"),
    "job": ("spec",),
}


def _retype(to: str) -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, columns in COLUMNS.items():
        changes = ", ".join(f'ALTER COLUMN "{c}" TYPE {to} USING "{c}"::{to}' for c in columns)
        op.execute(f'ALTER TABLE "{table}" {changes}')


def upgrade() -> None:
    _retype("json")


def downgrade() -> None:
    _retype("jsonb")
