"""Migrating a read-model file is all or nothing, and a file no hearth can use (corrupt, from a newer schema, with
tables but no schema revision) is refused in one line by `hearth db` and `hearth-replay rebuild --diff`, with its
bytes left as they were."""

from __future__ import annotations

import contextlib
import sqlite3

import pytest
from sqlalchemy import Engine, event
from typer.testing import CliRunner

from hearth.readmodels import db as readmodel_db
from hearth.readmodels.db import ReadModelUnusable, open_engine, upgrade_database
from hearth.readmodels.rebuild import diff_databases
from hearth.services.cli import app


def _head_revision() -> str:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(readmodel_db.alembic_config()).get_current_head()


# The newest migration: what an upgrade ends at.
HEAD_REVISION = _head_revision()


def table_sql(path, name: str) -> str:
    with contextlib.closing(sqlite3.connect(path)) as connection:
        return connection.execute("SELECT sql FROM sqlite_master WHERE name = ?", (name,)).fetchone()[0]


def schema_revision(path) -> str:
    with contextlib.closing(sqlite3.connect(path)) as connection:
        return connection.execute("SELECT version_num FROM alembic_version").fetchone()[0]


def test_a_migration_that_fails_midway_leaves_the_file_at_its_old_revision_and_a_retry_completes_it(tmp_path):
    path = tmp_path / "old.db"
    upgrade_database(path, "0015")
    with contextlib.closing(sqlite3.connect(path)) as connection, connection:
        connection.execute("INSERT INTO shard_reputation (shard_id, checks, verified_positions, mismatches, disputes, "
                           "status, updated_at) VALUES ('s1', 3, 2, 1, 0, 'ok', 100)")
        # 0016 adds a column, then creates this index: its second step fails (as a kill or a full disk would).
        connection.execute("CREATE INDEX ix_shard_reputation_quarantined_by ON shards (shard_id)")
    before = table_sql(path, "shard_reputation")

    with pytest.raises(Exception, match="already exists"):
        upgrade_database(path)

    assert schema_revision(path) == "0015" and table_sql(path, "shard_reputation") == before
    with contextlib.closing(sqlite3.connect(path)) as connection, connection:
        connection.execute("DROP INDEX ix_shard_reputation_quarantined_by")
    upgrade_database(path)  # was: "duplicate column name: quarantined_by", for good
    assert schema_revision(path) == HEAD_REVISION
    with contextlib.closing(sqlite3.connect(path)) as connection:
        assert connection.execute("SELECT shard_id, checks FROM shard_reputation").fetchall() == [("s1", 3)]


def a_newer_file(tmp_path):
    path = tmp_path / "newer.db"
    upgrade_database(path)
    with contextlib.closing(sqlite3.connect(path)) as connection, connection:
        connection.execute("UPDATE alembic_version SET version_num = '0099'")
    return path


def a_corrupt_file(tmp_path):
    path = tmp_path / "corrupt.db"
    path.write_bytes(b"not a database, whatever it was " * 256)
    return path


def an_unversioned_file(tmp_path):
    """A read model's tables without its alembic_version (made by an older `create_all`, or by hand)."""
    path = tmp_path / "unversioned.db"
    upgrade_database(path)
    with contextlib.closing(sqlite3.connect(path)) as connection, connection:
        connection.execute("DROP TABLE alembic_version")
    return path


def a_damaged_file(tmp_path):
    """A read model whose alembic_version page was overwritten: SQLite opens it, and finds it malformed on reading."""
    path = tmp_path / "damaged.db"
    upgrade_database(path)
    with contextlib.closing(sqlite3.connect(path)) as connection:
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        root = connection.execute("SELECT rootpage FROM sqlite_master WHERE name = 'alembic_version'").fetchone()[0]
        page_size = connection.execute("PRAGMA page_size").fetchone()[0]
    data = bytearray(path.read_bytes())
    data[(root - 1) * page_size:root * page_size] = b"\x07" * page_size
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("made", [a_newer_file, a_corrupt_file, a_damaged_file, an_unversioned_file])
def test_upgrade_refuses_a_file_it_cannot_use_and_leaves_its_bytes_alone(tmp_path, made):
    path = made(tmp_path)
    before = path.read_bytes()
    with pytest.raises(ReadModelUnusable) as refused:
        upgrade_database(path)
    assert str(path) in str(refused.value) and "\n" not in str(refused.value)
    assert path.read_bytes() == before


def test_a_newer_schema_is_named_as_such(tmp_path):
    with pytest.raises(ReadModelUnusable, match="0099.*newer than this hearth"):
        upgrade_database(a_newer_file(tmp_path))


@pytest.mark.parametrize("made", [a_newer_file, a_corrupt_file, a_damaged_file, an_unversioned_file])
@pytest.mark.parametrize("command", ["upgrade", "vacuum"])
def test_hearth_db_refuses_an_unusable_file_in_one_line(tmp_path, made, command):
    path = made(tmp_path)
    result = CliRunner().invoke(app, ["db", command, "--db", str(path)])
    if command == "vacuum" and made in (a_newer_file, an_unversioned_file):
        assert result.exit_code == 0, result.output  # a VACUUM keeps every row of any schema: nothing to refuse
        return
    assert result.exit_code == 1 and result.output.strip().count("\n") == 0, result.output
    assert "Traceback" not in result.output and str(path) in result.output


def test_a_file_with_tables_but_no_schema_revision_is_named_as_such(tmp_path):
    with pytest.raises(ReadModelUnusable, match="no schema revision.*hearth-replay rebuild"):
        upgrade_database(an_unversioned_file(tmp_path))


def test_a_file_with_an_empty_alembic_version_is_refused_as_one_without_a_revision(tmp_path):
    path = an_unversioned_file(tmp_path)
    with contextlib.closing(sqlite3.connect(path)) as connection, connection:
        connection.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL PRIMARY KEY)")
    with pytest.raises(ReadModelUnusable, match="no schema revision"):
        upgrade_database(path)


def test_an_empty_file_is_still_migrated(tmp_path):
    path = tmp_path / "empty.db"
    path.write_bytes(b"")
    upgrade_database(path)
    assert schema_revision(path) == HEAD_REVISION


def test_a_diff_against_a_file_without_a_schema_revision_names_it(tmp_path):
    (tmp_path / "new").mkdir()
    new = tmp_path / "new" / "new.db"
    upgrade_database(new)
    unversioned = an_unversioned_file(tmp_path)
    with pytest.raises(ReadModelUnusable, match=f"{unversioned}: .*no schema revision"):
        diff_databases(new, unversioned)


def test_open_engine_on_a_corrupt_file_fails_as_unusable(tmp_path):
    engine = open_engine(a_corrupt_file(tmp_path))
    try:
        with pytest.raises(ReadModelUnusable, match="not a read-model database"):
            with engine.connect():
                pass
    finally:
        engine.dispose()


@pytest.fixture
def disk_full_after_pages():
    """Every connection opened meanwhile may grow its file to a few pages only: SQLite then answers as on a full disk
    ("database or disk is full")."""

    def cap(dbapi_connection, _record) -> None:
        dbapi_connection.execute("PRAGMA max_page_count = 4")

    event.listen(Engine, "connect", cap)
    yield
    event.remove(Engine, "connect", cap)


def test_upgrade_on_a_full_disk_is_one_line_and_the_next_one_completes(tmp_path, disk_full_after_pages):
    path = tmp_path / "rm.db"
    with pytest.raises(ReadModelUnusable, match="cannot write it \\(database or disk is full\\)") as refused:
        upgrade_database(path)
    assert "\n" not in str(refused.value)
    result = CliRunner().invoke(app, ["db", "upgrade", "--db", str(path)])
    assert result.exit_code == 1 and result.output.strip().count("\n") == 0, result.output
    assert "database or disk is full" in result.output


def test_an_upgrade_after_a_full_disk_completes_once_there_is_room(tmp_path):
    path = tmp_path / "rm.db"
    cap = lambda dbapi_connection, _record: dbapi_connection.execute("PRAGMA max_page_count = 4")  # noqa: E731
    event.listen(Engine, "connect", cap)
    try:
        with pytest.raises(ReadModelUnusable):
            upgrade_database(path)
    finally:
        event.remove(Engine, "connect", cap)
    upgrade_database(path)
    assert schema_revision(path) == HEAD_REVISION


def test_upgrade_of_a_file_another_writer_holds_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "rm.db"
    monkeypatch.setattr(readmodel_db, "sqlite_busy_timeout_ms", 50)
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as writer:
        writer.execute("BEGIN IMMEDIATE")
        with pytest.raises(ReadModelUnusable, match="cannot write it \\(database is locked\\)"):
            upgrade_database(path)
        writer.execute("ROLLBACK")
    upgrade_database(path)
    assert schema_revision(path) == HEAD_REVISION


def test_a_diff_against_a_file_damaged_in_a_table_is_refused_naming_it(tmp_path):
    live = tmp_path / "live.db"
    upgrade_database(live)
    with contextlib.closing(sqlite3.connect(live)) as connection, connection:
        connection.executemany("INSERT INTO failovers VALUES (?, 1, 'x', '[]', 'made up', 0, 0)",
                               [(f"p{n}",) for n in range(300)])
    with contextlib.closing(sqlite3.connect(live)) as connection:
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        root = connection.execute("SELECT rootpage FROM sqlite_master WHERE name = 'failovers'").fetchone()[0]
        page_size = connection.execute("PRAGMA page_size").fetchone()[0]
    data = bytearray(live.read_bytes())
    data[(root - 1) * page_size:root * page_size] = b"\x07" * page_size
    live.write_bytes(bytes(data))
    new = tmp_path / "new.db"
    upgrade_database(new)
    with pytest.raises(ReadModelUnusable, match=f"{live}: not a read-model database SQLite can read"):
        diff_databases(new, live)
