"""Alembic runs this for every command: the revisions run on the connection `upgrade_to_head`
passes, or else on one to the configured URL (a developer writing a revision), or as SQL
(`--sql`, for an operator who applies it by hand)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine

from cloud.db import Base


def run_on(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=Base.metadata)
    with context.begin_transaction():  # joins the caller's transaction when there is one
        context.run_migrations()


config = context.config
if context.is_offline_mode():
    context.configure(
        url=config.get_main_option("sqlalchemy.url"), target_metadata=Base.metadata, literal_binds=True
    )
    with context.begin_transaction():
        context.run_migrations()
elif (given := config.attributes.get("connection")) is not None:
    run_on(given)
else:
    engine = create_engine(config.get_main_option("sqlalchemy.url"))
    with engine.connect() as connection:
        run_on(connection)
    engine.dispose()
