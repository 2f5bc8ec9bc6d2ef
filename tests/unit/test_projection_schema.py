"""The read-model schema comes only from Alembic, matches the SQLAlchemy models, and opens in WAL mode."""

from __future__ import annotations

from alembic import command
from sqlalchemy import inspect, text

from hearth.readmodels.db import alembic_config, open_engine, upgrade_database
from hearth.readmodels.tables import Base


def test_upgrade_creates_every_table_and_is_idempotent(tmp_path):
    path = tmp_path / "rm.db"
    upgrade_database(path)
    upgrade_database(path)
    engine = open_engine(path)
    try:
        names = set(inspect(engine).get_table_names())
        assert {table.name for table in Base.metadata.sorted_tables} | {"alembic_version"} == names
        with engine.connect() as connection:
            assert connection.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert connection.execute(text("PRAGMA synchronous")).scalar() == 1  # NORMAL
            assert connection.execute(text("PRAGMA busy_timeout")).scalar() > 0
            assert connection.execute(text("SELECT version_num FROM alembic_version")).scalar() == "0025"
    finally:
        engine.dispose()


def test_models_and_migrations_agree_and_downgrade_round_trips(tmp_path):
    path = tmp_path / "rm.db"
    upgrade_database(path)
    command.check(alembic_config(path))  # raises if autogenerate would emit any operation
    command.downgrade(alembic_config(path), "base")
    engine = open_engine(path)
    assert set(inspect(engine).get_table_names()) == {"alembic_version"}
    engine.dispose()
    upgrade_database(path)
    command.check(alembic_config(path))
