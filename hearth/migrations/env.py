"""Alembic environment for the read-model schema: migrates the SQLite file of the config or `-x db=PATH`."""

from __future__ import annotations

from alembic import context
from sqlalchemy import engine_from_config, pool

from hearth.readmodels.tables import Base

config = context.config
target_metadata = Base.metadata


def _database_url() -> str:
    db_path = context.get_x_argument(as_dictionary=True).get("db")
    if db_path:
        return f"sqlite:///{db_path}"
    return config.get_main_option("sqlalchemy.url")


def run_migrations_offline() -> None:
    context.configure(
        url=_database_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,  # SQLite cannot ALTER most things; batch mode rebuilds the table instead
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    # upgrade_database() hands over an open connection so migrations use the same pragmas as the app.
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_on(connection)
        return
    engine = engine_from_config(
        {"sqlalchemy.url": _database_url()}, prefix="sqlalchemy.", poolclass=pool.NullPool
    )
    with engine.connect() as connection:
        _run_on(connection)
    engine.dispose()


def _run_on(connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
