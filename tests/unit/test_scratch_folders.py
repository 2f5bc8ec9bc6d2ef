"""A process's scratch folder (a host's coverage, an orchestrator's routing read model) does not outlive it: removed
when the stop deadline cuts its shutdown short, and after a SIGKILL by the next process of its kind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from hearth.services.common.scratch_folders import OWNER_LOCK, ScratchFolder, remove_abandoned_scratch_folders

PREFIX = "hearth-test-scratch-"
child_timeout_s = 60


@pytest.fixture(autouse=True)
def own_temporary_directory(tmp_path, monkeypatch):
    """Scratch folders of this test (and of its child processes) go under tmp_path, not the machine's /tmp."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))


def start_owner(script: str) -> tuple[subprocess.Popen, Path]:
    """A child process that makes a ScratchFolder, prints its path, then runs `script`."""
    code = textwrap.dedent("""
        import sys, time
        from hearth.services.common.scratch_folders import ScratchFolder
        folder = ScratchFolder(sys.argv[1])
        print(folder.path, flush=True)
    """) + textwrap.dedent(script)
    child = subprocess.Popen([sys.executable, "-c", code, PREFIX], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    path = Path(child.stdout.readline().strip())
    assert path.is_dir() and (path / OWNER_LOCK).is_file()
    return child, path


def test_a_killed_owners_folder_is_removed_by_the_next_folder_of_its_kind():
    child, path = start_owner("time.sleep(60)")
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=child_timeout_s)
    assert path.is_dir()  # nothing runs in a killed process
    folder = ScratchFolder(PREFIX)
    try:
        assert not path.exists()
    finally:
        folder.cleanup()
    assert not folder.path.exists()


def test_a_living_owners_folder_is_kept():
    child, path = start_owner("time.sleep(60)")
    try:
        assert remove_abandoned_scratch_folders(PREFIX) == []
        assert path.is_dir()
    finally:
        child.kill()
        child.wait(timeout=child_timeout_s)


def test_an_owner_that_exits_removes_its_folder():
    child, path = start_owner("sys.stdin.readline()")
    child.stdin.write("go\n")
    child.stdin.close()
    assert child.wait(timeout=child_timeout_s) == 0
    assert not path.exists()


def test_folders_without_an_owner_lock_and_of_other_kinds_are_left_alone(tmp_path):
    without_lock = tmp_path / f"{PREFIX}not-ours"
    without_lock.mkdir()
    other_kind = tmp_path / "hearth-test-other-x"
    other_kind.mkdir()
    (other_kind / OWNER_LOCK).touch()
    assert remove_abandoned_scratch_folders(PREFIX) == []
    assert without_lock.is_dir() and other_kind.is_dir()


def test_the_stop_deadline_removes_the_folder_of_a_process_it_ends():
    """The deadline exits with os._exit (no exit handlers): a shutdown slower than stop_deadline_s left the folder."""
    child, path = start_owner("""
        from hearth.services.common.lifecycle import start_stop_deadline
        start_stop_deadline(0.2)
        time.sleep(60)  # a shutdown that does not finish in time
    """)
    assert child.wait(timeout=child_timeout_s) == 0
    assert not path.exists()
