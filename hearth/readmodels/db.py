"""Opens read-model SQLite files (WAL: readers never block the projector) and migrates them with Alembic."""

from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

# A writer holding the lock (the projector commits every batch) must not make readers fail immediately.
sqlite_busy_timeout_ms = 5_000


def _set_sqlite_pragmas(dbapi_connection, _connection_record) -> None:
    cursor = dbapi_connection.cursor()
    try:
        # WAL: readers see the last committed snapshot while the projector writes.
        cursor.execute("PRAGMA journal_mode=WAL")
        # NORMAL is durable against application crashes in WAL mode; a power loss may drop the last
        # transactions, which is harmless here because the position rolls back with them (replay redoes them).
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout={sqlite_busy_timeout_ms}")
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


def database_url(path: str | Path) -> str:
    return f"sqlite:///{Path(path)}"


def open_engine(path: str | Path) -> Engine:
    """An engine on the SQLite file `path`; every connection gets WAL, synchronous=NORMAL, a busy timeout."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        database_url(path),
        # The projector applies batches in a worker thread while the event loop thread may read.
        connect_args={"check_same_thread": False},
    )
    event.listen(engine, "connect", _set_sqlite_pragmas)
    return engine


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(path: str | Path | None = None) -> Config:
    """The Alembic config shipped inside the `migrations` package, pointed at the database `path`."""
    migrations_dir = resources.files("hearth.migrations")
    config = Config(str(migrations_dir / "alembic.ini"))
    config.set_main_option("script_location", str(migrations_dir))
    if path is not None:
        config.set_main_option("sqlalchemy.url", database_url(path))
    return config


def upgrade_database(path: str | Path, revision: str = "head") -> None:
    """Create or migrate the read-model schema at `path` to `revision` (tables are created only this way)."""
    engine = open_engine(path)
    try:
        with engine.begin() as connection:
            config = alembic_config(path)
            config.attributes["connection"] = connection
            command.upgrade(config, revision)
    finally:
        engine.dispose()
    log.debug("read-model database %s migrated to %s", path, revision)
