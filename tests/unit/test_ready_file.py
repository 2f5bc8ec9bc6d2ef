"""A process's `--ready-file` is written whole at once: a reader that waits for it to exist (LocalCluster, a compose
healthcheck, a script) reads what it says, never an empty or half-written file, also when a `hearth host` rewrites it
at a move. It is written as every state file is (trust.keys.write_private_file: synced, 0600), and a link planted at
its path is refused: at start by every command, and when written."""

from __future__ import annotations

import os
import stat

import pytest
from typer.testing import CliRunner

from hearth.services.cli import app
from hearth.services.common.lifecycle import CommandRefused, write_ready_file


def test_a_ready_file_is_replaced_whole_never_truncated_in_place(tmp_path):
    """Before, `open(path, "w")` truncated the file, then wrote: waiting for it to exist, LocalCluster returned and the
    shard id read from it was "" (seen starting a `hearth host` whose node had served before). A reader holding the
    file open now keeps reading the old text whole, and the path names the new text whole."""
    ready = tmp_path / "host.ready"
    write_ready_file(ready, "tiny:0-1@host-a")
    with open(ready) as reader:  # a script reading the file as the host moves
        write_ready_file(ready, "tiny:2-3@host-a")
        assert reader.read() == "tiny:0-1@host-a"
    assert ready.read_text() == "tiny:2-3@host-a"
    assert [path.name for path in tmp_path.iterdir()] == ["host.ready"]  # nothing left beside it


def test_a_ready_file_in_the_current_folder_is_written_there(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_ready_file("shard.ready", "s")
    assert (tmp_path / "shard.ready").read_text() == "s"


def test_a_ready_file_is_synced_before_it_is_renamed_in(tmp_path, monkeypatch):
    """Written by trust.keys.write_private_file, the project's one helper for a state file: before, the ready file
    had its own temporary-file-and-rename without the fsync, so after a power cut its name could point at nothing."""
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda descriptor: (synced.append(descriptor), real_fsync(descriptor)))
    write_ready_file(tmp_path / "shard.ready", "s")
    assert synced and (tmp_path / "shard.ready").read_text() == "s"
    assert stat.S_IMODE((tmp_path / "shard.ready").stat().st_mode) == 0o600


def test_a_link_planted_at_the_ready_file_is_refused_not_written_through_nor_replaced(tmp_path):
    target = tmp_path / "someone-elses-file"
    target.write_text("theirs")
    planted = tmp_path / "host.ready"
    planted.symlink_to(target)
    with pytest.raises(CommandRefused, match="host.ready") as refusal:
        write_ready_file(planted, "tiny:0-1@host-a")
    assert "\n" not in str(refusal.value)
    assert planted.is_symlink() and target.read_text() == "theirs"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["host.ready", "someone-elses-file"]


@pytest.mark.parametrize("argv", [
    ["projector", "--db", "rm.sqlite", "--insecure"],
    ["orchestrator", "--insecure"],
    ["shard", "--model", "m", "--layers", "0-1", "--insecure"],
    ["host", "--model", "m", "--insecure"],
    ["gateway", "--insecure", "--port", "0"],
])
def test_every_command_refuses_a_linked_ready_file_in_one_line_before_it_starts(argv, tmp_path, monkeypatch):
    """A usage error (exit code 2) before anything starts: no connection tried, no model loaded, no port opened."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HEARTH_CONFIG", raising=False)
    (tmp_path / "planted.ready").symlink_to(tmp_path / "elsewhere")
    result = CliRunner().invoke(app, [*argv, "--ready-file", "planted.ready", "--nats", "nats://127.0.0.1:1"])
    assert result.exit_code == 2, (argv, result.output)
    assert "Invalid value for '--ready-file'" in result.output and "symbolic link" in result.output, result.output
    assert not (tmp_path / "elsewhere").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["planted.ready"]
