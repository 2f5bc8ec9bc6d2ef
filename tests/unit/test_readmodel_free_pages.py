"""The read model's file gives back what pruning frees: new files are made on incremental auto-vacuum, an older file
is switched by one VACUUM at its next upgrade, pruning releases the free pages in bounded steps in the write turn,
and `hearth db vacuum` rewrites a file whole (refusing in one line what it cannot)."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path

from alembic import command
from sqlalchemy import text
from sqlalchemy.orm import sessionmaker
from typer.testing import CliRunner

from hearth.events.streams import PIPELINES_STREAM, seconds_per_day
from hearth.readmodels import db as readmodel_db
from hearth.readmodels import retention
from hearth.readmodels.db import alembic_config, auto_vacuum_incremental, open_engine, upgrade_database
from hearth.readmodels.positions import PROJECTION_NAME
from hearth.readmodels.retention import keep_pruning, prune_all, retention_policy
from hearth.services.cli import app
from hearth.services.common.config import ReadModelSettings

POLICY = retention_policy(ReadModelSettings())
HISTORY_ROWS = 20_000


def bytes_on_disk(path: Path) -> int:
    wal = path.with_name(path.name + "-wal")
    return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)


def pragma(path: Path, name: str):
    with contextlib.closing(sqlite3.connect(path)) as connection:
        return connection.execute(f"PRAGMA {name}").fetchone()[0]


def fill_with_old_history(path: Path, rows: int = HISTORY_ROWS) -> int:
    """`rows` failovers a month and more older than the pipelines stream's clock: history the retention prunes; the
    file's size on disk once closed."""
    engine = open_engine(path)
    try:
        with engine.begin() as connection:
            connection.execute(text(
                "INSERT INTO failovers VALUES (:pipeline, 1, 'failed-shard', '[\"replacement-shard\"]', 'stalled', 3, "
                ":at)"), [dict(pipeline=f"p-{i:08d}", at=1_000 + i) for i in range(rows)])
            connection.execute(text(
                "INSERT INTO projection_positions (projection, stream, last_seq, last_event_at) "
                "VALUES (:projection, :stream, 1, :clock)"),
                dict(projection=PROJECTION_NAME, stream=PIPELINES_STREAM, clock=1_000 + rows + 31 * seconds_per_day))
    finally:
        engine.dispose()
    return bytes_on_disk(path)


def prune(path: Path) -> int:
    engine = open_engine(path)
    try:
        return prune_all(sessionmaker(engine), POLICY, PROJECTION_NAME)
    finally:
        engine.dispose()  # the last connection checkpoints the WAL: the file is cut to the pages in use


def made_without_incremental_auto_vacuum(path: Path) -> Path:
    """A read model as files were made before: Alembic's own engine, none of open_engine's pragmas."""
    command.upgrade(alembic_config(path), "head")
    assert pragma(path, "auto_vacuum") == 0
    return path


def test_pruning_gives_the_freed_pages_back_to_the_disk(tmp_path):
    path = tmp_path / "rm.db"
    upgrade_database(path)
    assert pragma(path, "auto_vacuum") == auto_vacuum_incremental and pragma(path, "journal_mode") == "wal"
    full = fill_with_old_history(path)

    assert prune(path) == HISTORY_ROWS

    assert bytes_on_disk(path) < full / 4
    assert pragma(path, "freelist_count") == 0


def test_a_file_made_before_is_switched_once_at_its_upgrade_and_keeps_its_rows(tmp_path):
    path = made_without_incremental_auto_vacuum(tmp_path / "old.db")
    full = fill_with_old_history(path)

    upgrade_database(path)

    assert pragma(path, "auto_vacuum") == auto_vacuum_incremental and pragma(path, "journal_mode") == "wal"
    assert prune(path) == HISTORY_ROWS  # every row kept through the rewrite
    assert bytes_on_disk(path) < full / 4


async def test_a_projectors_pruner_releases_the_pages_in_bounded_steps_holding_the_write_turn(tmp_path, monkeypatch):
    path = tmp_path / "rm.db"
    upgrade_database(path)
    full = fill_with_old_history(path)
    turn = asyncio.Lock()
    steps: list[tuple[int, bool]] = []

    def recorded_release(session, max_pages):
        released = readmodel_db.release_free_pages(session, max_pages)
        steps.append((released, turn.locked()))
        return released

    monkeypatch.setattr(retention, "release_step_pages", 40)
    monkeypatch.setattr(retention, "release_free_pages", recorded_release)
    engine = open_engine(path)
    policy = retention_policy(ReadModelSettings(prune_interval_s=0.01))
    task = asyncio.create_task(keep_pruning(sessionmaker(engine), policy, PROJECTION_NAME, turn, lambda rows: None))
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while not (steps and steps[-1][0] == 0):
            assert asyncio.get_running_loop().time() < deadline, steps[-3:]
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        engine.dispose()
    released = [pages for pages, _held in steps]
    assert len(released) > 2 and max(released) <= 40 and all(held for _pages, held in steps)
    assert bytes_on_disk(path) < full / 4


def test_hearth_db_vacuum_rewrites_a_file_without_its_free_pages(tmp_path):
    path = made_without_incremental_auto_vacuum(tmp_path / "old.db")
    fill_with_old_history(path)
    with contextlib.closing(sqlite3.connect(path)) as connection, connection:
        connection.execute("DELETE FROM failovers")
    full = bytes_on_disk(path)

    result = CliRunner().invoke(app, ["db", "vacuum", "--db", str(path)])

    assert result.exit_code == 0, result.output
    assert bytes_on_disk(path) < full / 4 and pragma(path, "auto_vacuum") == auto_vacuum_incremental


def test_hearth_db_vacuum_refuses_in_one_line_a_missing_file_or_one_another_writer_holds(tmp_path, monkeypatch):
    missing = CliRunner().invoke(app, ["db", "vacuum", "--db", str(tmp_path / "none.db")])
    assert missing.exit_code == 2 and missing.output.strip().count("\n") == 0, missing.output
    assert not (tmp_path / "none.db").exists()

    path = tmp_path / "rm.db"
    upgrade_database(path)
    monkeypatch.setattr(readmodel_db, "sqlite_busy_timeout_ms", 50)
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as writer:
        writer.execute("BEGIN IMMEDIATE")
        locked = CliRunner().invoke(app, ["db", "vacuum", "--db", str(path)])
        writer.execute("ROLLBACK")
    assert locked.exit_code == 1 and locked.output.strip().count("\n") == 0, locked.output
    assert "not vacuumed: database is locked" in locked.output


def test_the_wal_is_cut_back_after_a_checkpoint_while_the_file_stays_open(tmp_path):
    path = tmp_path / "rm.db"
    upgrade_database(path)
    engine = open_engine(path)
    wal = path.with_name(path.name + "-wal")
    try:
        with engine.begin() as connection:  # one transaction far larger than the limit, as a rebuild's batch
            connection.execute(text(
                "INSERT INTO failovers VALUES (:pipeline, 1, 'failed-shard', '[\"replacement-shard\"]', 'stalled', 3, "
                ":at)"), [dict(pipeline=f"p-{i:08d}-{'x' * 200}", at=1_000 + i) for i in range(60_000)])
        with engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA journal_size_limit").scalar() == \
                readmodel_db.wal_size_limit_bytes
            connection.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")
            connection.exec_driver_sql("INSERT INTO failovers VALUES ('later', 1, 's', '[]', 'stalled', 3, 1)")
            connection.commit()  # the next writer after a checkpoint restarts the WAL, cut to the limit
        assert wal.exists() and wal.stat().st_size <= 4 * 1024 * 1024
    finally:
        engine.dispose()
