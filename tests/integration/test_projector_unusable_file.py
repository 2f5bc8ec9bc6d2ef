"""`hearth projector` on a read-model file it cannot use (corrupt, damaged, of a newer schema, with tables but no
schema revision) ends in one line, exit 1, and leaves the file's bytes as they were."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from hearth.readmodels.db import upgrade_database
from tests.unit.test_readmodel_upgrade_safety import a_damaged_file, an_unversioned_file

pytestmark = pytest.mark.integration

HEARTH = str(Path(sys.executable).parent / "hearth")
ENV = {**{k: v for k, v in os.environ.items() if k not in ("HEARTH_NATS_URL", "HEARTH_CONFIG")},
       "HEARTH_NATS__INSECURE": "1"}


def newer(path: Path) -> Path:
    upgrade_database(path)
    with contextlib.closing(sqlite3.connect(path)) as connection, connection:
        connection.execute("UPDATE alembic_version SET version_num = '0099'")
    return path


def corrupt(path: Path) -> Path:
    path.write_bytes(b"not a database " * 512)
    return path


def damaged(path: Path) -> Path:
    return a_damaged_file(path.parent)


def unversioned(path: Path) -> Path:
    return an_unversioned_file(path.parent)


@pytest.mark.parametrize("made", [newer, corrupt, damaged, unversioned])
def test_the_projector_refuses_a_file_it_cannot_use_in_one_line(made, nats_url, tmp_path):
    path = made(tmp_path / "read.sqlite")
    before = path.read_bytes()
    completed = subprocess.run([HEARTH, "projector", "--db", str(path), "--nats", nats_url], capture_output=True,
                               text=True, env=ENV, timeout=60)
    assert completed.returncode == 1, completed.stderr
    assert "Traceback" not in completed.stderr
    refusal = [line for line in completed.stderr.splitlines() if line.startswith("hearth projector: ")]
    assert len(refusal) == 1 and str(path) in refusal[0], completed.stderr
    assert path.read_bytes() == before
