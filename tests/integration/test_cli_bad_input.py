"""Bad input to `hearth` and `hearth-replay` as real processes, run from a folder outside the repository: each ends in
one line naming what and why (exit code 2 for usage, 1 otherwise), no traceback, nothing started or written. Before,
a NATS URL with a port out of range ended in nats-py's traceback, `hearth nats --port 70000` in nats-server's whole
log, `hearth bench --work-dir` under a file in an OSError traceback, and `hearth-replay --creds` naming a missing key
in an IdentityError traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
HEARTH, HEARTH_REPLAY = str(BIN / "hearth"), str(BIN / "hearth-replay")
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("HEARTH_")}, "OMP_NUM_THREADS": "1"}
LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
exit_timeout_s = 60.0


def said(args: list[str], cwd: Path, code: int, *expected: str, env: dict[str, str] | None = None) -> str:
    completed = subprocess.run(args, capture_output=True, text=True, env={**ENV, **(env or {})}, cwd=cwd,
                               timeout=exit_timeout_s)
    lines = [line for line in completed.stderr.splitlines() if line.strip() and not LOG_RECORD.match(line)]
    assert completed.returncode == code, completed.stderr
    assert "Traceback" not in completed.stderr, completed.stderr
    assert len(lines) == 1 and all(part in lines[0] for part in expected), completed.stderr
    return lines[0]


@pytest.mark.parametrize("args", [
    [HEARTH, "chat", "hi", "--insecure", "--nats", "nats://127.0.0.1:99999"],
    [HEARTH, "shard", "--model", "m", "--layers", "0-1", "--insecure", "--nats", "nats://127.0.0.1:99999"],
    [HEARTH_REPLAY, "events", "--nats", "nats://127.0.0.1:99999"],
], ids=["chat", "shard", "hearth-replay"])
def test_a_nats_url_out_of_range_is_a_usage_error(args, tmp_path):
    line = said(args, tmp_path, 2, "Invalid value for '--nats'", "Port out of range")
    assert line.startswith(f"{args[0].rsplit('/', 1)[1]} "), line


def test_a_nats_url_out_of_range_in_the_configuration_is_refused_naming_its_key(tmp_path):
    (tmp_path / "hearth.toml").write_text('[nats]\nurl = "nats://127.0.0.1:99999"\n')
    said([HEARTH, "--config", "hearth.toml", "models", "--insecure"], tmp_path, 2, "[nats] url", "Port out of range")


def test_hearth_nats_refuses_a_port_out_of_range_before_starting(tmp_path):
    said([HEARTH, "nats", "--port", "70000", "--store", "store"], tmp_path, 2, "Invalid value for '--port'")
    assert not (tmp_path / "store").exists()


def test_a_work_folder_that_cannot_be_created_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("not a folder")
    said([HEARTH, "bench", "--work-dir", "notes.txt/work", "--repeats", "1"], tmp_path, 1,
         "hearth bench: notes.txt/work: notes.txt is not a folder")


def test_hearth_replay_refuses_a_missing_key_file_in_one_line(tmp_path):
    # EXIT_REFUSED (1), as every command that cannot use its key file
    said([HEARTH_REPLAY, "--creds", "member.nk", "events", "--nats", "nats://127.0.0.1:1"], tmp_path, 1,
         "hearth-replay: cannot read the key file member.nk")
