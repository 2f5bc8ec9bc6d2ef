"""`hearth db backup` copies a read model while its projector writes it: every committed batch, those still in the
WAL included, and no half of one (hearth/readmodels/db.py, `backup_database`). Walking the docs, nothing said how to
back one up, and copying the file as it ran left out the batches its WAL still held (its positions ran behind by
dozens of events)."""

from __future__ import annotations

import shutil

import pytest
from sqlalchemy import create_engine, event, text
from sqlalchemy.pool import StaticPool
from typer.testing import CliRunner

from hearth.readmodels.db import open_engine, upgrade_database
from hearth.services.cli import app
from tests.readmodel_helpers import LogBuilder, apply_all, dump_rows, migrated_engine, synthetic_events


def written_and_held_open(path):
    """A read model whose last batches are in its WAL, as a running projector's are between checkpoints."""
    engine = migrated_engine(path)
    with engine.connect() as connection:
        connection.execute(text("PRAGMA wal_autocheckpoint=0"))
    log = LogBuilder()
    events = [log.stored(event) for event in synthetic_events()]
    apply_all(engine, events[:40])
    with engine.connect() as connection:
        connection.execute(text("PRAGMA wal_checkpoint(TRUNCATE)"))
    engine.dispose()
    # One pooled connection, kept open: its batches stay in the WAL (no automatic checkpoint) until it closes.
    engine = create_engine(f"sqlite:///{path}", poolclass=StaticPool)
    with engine.connect() as connection:
        connection.exec_driver_sql("PRAGMA wal_autocheckpoint=0")
    apply_all(engine, events[40:])
    return engine, dump_rows(engine)


def test_the_copy_holds_what_the_wal_holds_while_the_projector_has_it_open(tmp_path):
    live = tmp_path / "readmodel.sqlite"
    engine, rows = written_and_held_open(live)
    try:
        assert (tmp_path / "readmodel.sqlite-wal").stat().st_size > 0
        shutil.copyfile(live, tmp_path / "file-copy.sqlite")  # what an operator without the command would do
        result = CliRunner().invoke(app, ["db", "backup", "--db", str(live), "--out", str(tmp_path / "copy.sqlite")])
        assert result.exit_code == 0, result.output
    finally:
        engine.dispose()
    copy = open_engine(tmp_path / "copy.sqlite")
    upgrade_database(tmp_path / "copy.sqlite")  # a projector started on it takes it as it is
    assert dump_rows(copy) == rows
    copy.dispose()
    file_copy = open_engine(tmp_path / "file-copy.sqlite")
    assert dump_rows(file_copy) != rows  # the batches in the WAL are not in the file alone
    file_copy.dispose()
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith(".")) == []


def test_a_missing_file_or_an_existing_copy_is_refused_in_one_line(tmp_path):
    missing = CliRunner().invoke(app, ["db", "backup", "--db", str(tmp_path / "none.sqlite"),
                                       "--out", str(tmp_path / "copy.sqlite")])
    assert missing.exit_code == 2 and "no such read-model file" in missing.output
    live = tmp_path / "readmodel.sqlite"
    migrated_engine(live).dispose()
    taken = tmp_path / "copy.sqlite"
    taken.write_text("keep me")
    refused = CliRunner().invoke(app, ["db", "backup", "--db", str(live), "--out", str(taken)])
    assert refused.exit_code == 2 and "exists" in refused.output and taken.read_text() == "keep me"
    assert len(refused.output.strip().splitlines()) == 1


def test_a_file_that_appears_at_the_copy_while_it_is_written_is_kept(tmp_path):
    """The command's check that --out does not exist comes before the copy: a file made there meanwhile (another
    backup, another program) stays as it was and the backup is refused, never renamed over it."""
    from hearth.readmodels.db import backup_database

    live = tmp_path / "readmodel.sqlite"
    engine = migrated_engine(live)
    taken = tmp_path / "copy.sqlite"

    @event.listens_for(engine, "before_cursor_execute")
    def appear_meanwhile(conn, cursor, statement, parameters, context, executemany):
        if statement.startswith("VACUUM INTO"):
            taken.write_text("made meanwhile")

    try:
        with pytest.raises(FileExistsError):
            backup_database(engine, taken)
    finally:
        engine.dispose()
    assert taken.read_text() == "made meanwhile"
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith(".")) == []
