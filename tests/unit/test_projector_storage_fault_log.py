"""A projector's read-model file refusing writes (hearth/readmodels/storage_fault_log.py) is said once at ERROR with
"disk full" and the file, then at most once every `repeat_every_s` while it lasts, and once when writes work again."""

from __future__ import annotations

import logging
import sqlite3

import pytest

from hearth.readmodels.storage_fault_log import StorageFaultLog, repeat_every_s


def full_disk_error() -> sqlite3.OperationalError:
    connection = sqlite3.connect(":memory:")
    connection.execute("CREATE TABLE t (x BLOB)")
    pages = connection.execute("PRAGMA page_count").fetchone()[0]
    connection.execute(f"PRAGMA max_page_count = {pages}")
    try:
        with pytest.raises(sqlite3.OperationalError) as raised:
            connection.execute("INSERT INTO t VALUES (?)", (b"x" * 100_000,))
    finally:
        connection.close()
    return raised.value


def projector_lines(caplog, level):
    return [record.getMessage() for record in caplog.records
            if record.name == "hearth.readmodels.runner" and record.levelno == level]


def test_a_full_disk_is_said_once_then_rarely_and_its_end_once(tmp_path, caplog):
    now = [0.0]
    faults = StorageFaultLog(tmp_path / "rm.db", clock=lambda: now[0])
    error = full_disk_error()
    with caplog.at_level(logging.DEBUG, logger="hearth.readmodels.runner"):
        for _ in range(30):
            assert faults.said(error, retry_s=10.0)
            now[0] += 5.0
        errors = projector_lines(caplog, logging.ERROR)
        assert len(errors) == 1, errors
        assert f"cannot write {tmp_path / 'rm.db'} (disk full: database or disk is full)" in errors[0]
        now[0] += repeat_every_s
        faults.said(error, retry_s=10.0)
        assert len(projector_lines(caplog, logging.ERROR)) == 2
        assert "(30 refused tries since this was last said" in projector_lines(caplog, logging.ERROR)[1]
        faults.cleared()
        faults.cleared()
        assert projector_lines(caplog, logging.WARNING) == [
            f"projector: writing {tmp_path / 'rm.db'} again; applying from where it stopped"]
        for _ in range(10):  # a nearly full disk, refusing some batches and taking others: no more lines for now
            faults.said(error, retry_s=0.5)
            faults.cleared()
            now[0] += 1.0
    assert len(projector_lines(caplog, logging.ERROR)) == 2
    assert len(projector_lines(caplog, logging.WARNING)) == 1


def test_an_error_that_is_no_storage_fault_is_left_to_the_caller(tmp_path):
    faults = StorageFaultLog(tmp_path / "rm.db")
    assert not faults.said(ValueError("a handler's"), retry_s=1.0)
    assert not faults.said(sqlite3.IntegrityError("UNIQUE constraint failed"), retry_s=1.0)
