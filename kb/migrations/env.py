"""Alembic environment: runs on the connection kb.db hands it (no alembic.ini, no URL lookup)."""
from alembic import context
from sqlmodel import SQLModel

from kb.models import on_this_dialect  # (importing kb.models registers the tables on SQLModel.metadata)

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=SQLModel.metadata,
    render_as_batch=connection.dialect.name == "sqlite",   # SQLite alters tables by copy
    compare_type=True,
    include_object=on_this_dialect(connection.dialect.name),   # an index only one store has
)
with context.begin_transaction():
    context.run_migrations()
