"""Opens read-model SQLite files (WAL: readers never block the projector), migrates them with Alembic, and gives the
pages that pruning frees back to the disk (incremental auto-vacuum)."""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.exc import DatabaseError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from hearth.readmodels.batch_rows import session_cursor
from hearth.readmodels.newer_events import tell_of_events_now_readable

log = logging.getLogger(__name__)

# A writer holding the lock (the projector commits every batch) must not make readers fail immediately.
sqlite_busy_timeout_ms = 5_000
# What a WAL file is cut back to after a checkpoint: one large transaction (a rebuild's batch, a pruning pass) would
# otherwise leave it at its largest size on disk for as long as the file is open.
wal_size_limit_bytes = 4 * 1024 * 1024
# `PRAGMA auto_vacuum`'s value for INCREMENTAL: free pages stay in the file until `PRAGMA incremental_vacuum`.
auto_vacuum_incremental = 2


# SQLite's answers for a file that is not a database, or one whose pages are damaged.
_unreadable_file_codes = frozenset({sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT})
# Its answers for a file that cannot be written now: no room, read-only, cannot be opened, an I/O error, another
# writer holding it past the busy timeout (`hearth db vacuum`, say).
_storage_fault_codes = frozenset({sqlite3.SQLITE_FULL, sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN,
                                  sqlite3.SQLITE_IOERR, sqlite3.SQLITE_PERM, sqlite3.SQLITE_BUSY})


class ReadModelUnusable(RuntimeError):
    """A read-model file this hearth cannot use as it is (not a SQLite database, damaged, of a newer schema or of none,
    or not writable now: a full disk, a read-only file, another writer holding it); the message is one line naming the
    file, and the file is left as it was. `sqlite_said`: SQLite's own words, for a file it found damaged."""

    sqlite_said: str | None = None


def damaged_file(path: object, error: BaseException) -> ReadModelUnusable | None:
    """ReadModelUnusable for an error (SQLAlchemy's or sqlite3's) that says the file is not a database or is damaged;
    None for any other."""
    cause = getattr(error, "orig", error)
    code = getattr(cause, "sqlite_errorcode", None)
    if code is None or code & 0xFF not in _unreadable_file_codes:  # extended codes keep the primary in the low byte
        return None
    unusable = ReadModelUnusable(
        f"{path}: not a read-model database SQLite can read ({cause}); rebuild it from the event log "
        f"(hearth-replay rebuild --db {path} --force; move it aside first to keep it)")
    unusable.sqlite_said = str(cause)
    return unusable


@contextlib.contextmanager
def refusing_a_damaged_file(path: object) -> Iterator[None]:
    """ReadModelUnusable (one line, naming `path`) in place of SQLite's error when it finds the file damaged."""
    try:
        yield
    except (DatabaseError, sqlite3.DatabaseError) as error:
        if (damaged := damaged_file(path, error)) is None:
            raise
        raise damaged from None


def storage_fault(error: BaseException) -> str | None:
    """What keeps the file from being written (SQLite's words: "database or disk is full", ...), when `error` is that
    and not a fault of the SQL or the rows; None otherwise."""
    cause = getattr(error, "orig", error)
    code = getattr(cause, "sqlite_errorcode", None)
    return str(cause) if code is not None and code & 0xFF in _storage_fault_codes else None


def _set_sqlite_pragmas(dbapi_connection, _connection_record) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout={sqlite_busy_timeout_ms}")
        _refuse_an_unreadable_file(cursor)
        # A new file is made able to give pages back: auto_vacuum takes only before the first page is written,
        # which entering WAL does. An older file is switched by one full VACUUM (switch_to_incremental_vacuum).
        if cursor.execute("PRAGMA page_count").fetchone()[0] == 0:
            cursor.execute("PRAGMA auto_vacuum=INCREMENTAL")
        # WAL: readers see the last committed snapshot while the projector writes.
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA journal_size_limit={wal_size_limit_bytes}")
        # NORMAL is durable against application crashes in WAL mode; a power loss may drop the last
        # transactions, which is harmless here because the position rolls back with them (replay redoes them).
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


def _refuse_an_unreadable_file(cursor) -> None:
    # The first read of the file's header: where a file that is no database says so, before any pragma writes to it.
    try:
        cursor.execute("PRAGMA schema_version").fetchone()
    except sqlite3.DatabaseError as error:
        if (damaged := damaged_file(cursor.execute("PRAGMA database_list").fetchone()[2], error)) is not None:
            raise damaged from None
        raise


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
    """Create or migrate the read-model schema at `path` to `revision` (tables are created only this way), and switch
    a file made before incremental auto-vacuum to it. ReadModelUnusable (one line) for a file it cannot use or write.
    Migrated to the head, it says which events an older projector skipped as a newer hearth's this one reads."""
    engine = open_engine(path)
    try:
        with engine.begin() as connection:
            # pysqlite begins a transaction only before a row is written: without this each schema change of a
            # migration commits alone, and one stopped midway (killed, a full disk) leaves a file that no later
            # upgrade can finish ("duplicate column name"). SQLite's DDL is transactional inside one.
            connection.exec_driver_sql("BEGIN")
            config = alembic_config(path)
            config.attributes["connection"] = connection
            _refuse_an_unknown_schema(connection, config, path)
            command.upgrade(config, revision)
            if revision == "head":
                tell_of_events_now_readable(connection, path)
        switch_to_incremental_vacuum(engine)
    except DatabaseError as error:
        if (damaged := damaged_file(path, error)) is not None:
            raise damaged from None
        if (fault := storage_fault(error)) is None:
            raise
        raise ReadModelUnusable(f"{path}: cannot write it ({fault}); its schema is left as it was") from None
    finally:
        engine.dispose()
    log.debug("read-model database %s migrated to %s", path, revision)


def _refuse_an_unknown_schema(connection: Connection, config: Config, path: str | Path) -> None:
    """ReadModelUnusable when the file's schema is at a revision this hearth does not know (made by a newer one), or
    has tables but no revision at all (Alembic would take it for an empty file and fail creating its tables)."""
    tables = {name for (name,) in connection.exec_driver_sql(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\'")}
    stored_revisions = ([stored for (stored,) in connection.exec_driver_sql("SELECT version_num FROM alembic_version")]
                        if "alembic_version" in tables else [])
    if not stored_revisions:
        if tables - {"alembic_version"}:
            raise unversioned_file(path)
        return
    scripts = ScriptDirectory.from_config(config)
    known = {script.revision for script in scripts.walk_revisions()}
    for stored in stored_revisions:
        if stored not in known:
            raise ReadModelUnusable(
                f"{path}: its read-model schema is at revision {stored}, newer than this hearth knows (its latest: "
                f"{scripts.get_current_head()}); run a newer hearth on it, or rebuild one for this version into "
                "another file (hearth-replay rebuild)")


def unversioned_file(path: object) -> ReadModelUnusable:
    """The refusal of a file that holds no schema revision: no migration can tell what its tables are."""
    return ReadModelUnusable(
        f"{path}: holds no schema revision (no alembic_version row; made by hand, or by an older hearth's "
        "create_all), so hearth cannot tell which migrations its tables need; move it aside and rebuild one "
        "(hearth-replay rebuild)")


def _autocommit(engine: Engine) -> Connection:
    # VACUUM cannot run inside a transaction.
    return engine.connect().execution_options(isolation_level="AUTOCOMMIT")


def switch_to_incremental_vacuum(engine: Engine) -> None:
    """Give a file made without incremental auto-vacuum the one full VACUUM that switches it on. A file that cannot
    be rewritten now (a full disk: VACUUM needs room for two copies, its temporary one and the WAL) keeps working as
    before and is tried again at the next upgrade."""
    with _autocommit(engine) as connection:
        if connection.exec_driver_sql("PRAGMA auto_vacuum").scalar() == auto_vacuum_incremental:
            return
    try:
        vacuum_database(engine)
    except OperationalError as error:
        log.warning("read-model database %s: cannot switch it to incremental auto-vacuum now (%s); the pages pruning "
                    "frees are reused but not given back to the disk until it can", engine.url.database, error.orig)
        return
    log.info("read-model database %s switched to incremental auto-vacuum (one full VACUUM)", engine.url.database)


def vacuum_database(engine: Engine) -> None:
    """Rewrite the whole file without its free pages (a full VACUUM, which holds the write lock throughout and leaves
    the file on incremental auto-vacuum), then empty the WAL the rewrite went through."""
    with _autocommit(engine) as connection:
        # Read by VACUUM: the file it writes is switched to incremental auto-vacuum.
        connection.exec_driver_sql("PRAGMA auto_vacuum=INCREMENTAL")
        try:
            connection.exec_driver_sql("VACUUM")
        except DatabaseError as error:
            if (damaged := damaged_file(engine.url.database, error)) is not None:
                raise damaged from None
            raise
        # Every page went through the WAL, which would otherwise keep the file's size on disk beside it.
        connection.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")


def backup_database(engine: Engine, copy: Path) -> None:
    """Write a consistent copy of the file to `copy` while projectors keep writing it: one read transaction
    (`VACUUM INTO`), so it holds every committed batch, those still in the WAL included, and no half of one, which a
    file copy of a live read model does not promise. Written beside `copy` and renamed into place once whole and
    synced: a backup stopped midway leaves no file there. A file that appeared at `copy` meanwhile is not replaced
    (FileExistsError): the copy is linked into place, which fails where a name exists, and never renamed over it."""
    partial = copy.with_name(f".{copy.name}.partial")
    partial.unlink(missing_ok=True)
    try:
        with _autocommit(engine) as connection:
            try:
                connection.exec_driver_sql("VACUUM INTO ?", (str(partial),))
            except DatabaseError as error:
                if (damaged := damaged_file(engine.url.database, error)) is not None:
                    raise damaged from None
                raise
        with partial.open("rb") as written:
            os.fsync(written.fileno())
        os.link(partial, copy)
    finally:
        partial.unlink(missing_ok=True)


def release_free_pages(session: Session, max_pages: int) -> int:
    """Give at most `max_pages` of the file's free pages back to the disk, in a transaction of its own (in a session
    without one under way); how many it gave back (0 also when the file is not on incremental auto-vacuum)."""
    cursor = session_cursor(session)
    try:
        free_before = free_pages(cursor)
        if free_before == 0:
            return 0
        # A script runs the pragma to its end: it yields a row per page released, and execute() steps it only once.
        cursor.executescript(f"PRAGMA incremental_vacuum({int(max_pages)})")
        return free_before - free_pages(cursor)
    finally:
        cursor.close()


def free_pages(cursor) -> int:
    """Pages of the file that no table or index uses (`PRAGMA freelist_count`), given a DB-API cursor on it."""
    return cursor.execute("PRAGMA freelist_count").fetchone()[0]
