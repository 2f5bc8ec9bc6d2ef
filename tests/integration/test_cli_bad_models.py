"""Models a command cannot use end it with one line naming what and why, no traceback, as real processes: an
orchestrator's --preload that does not exist, is a folder holding several GGUFs or a `store:NAME` nobody published
(against a real broker)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

HEARTH = str(Path(sys.executable).parent / "hearth")
REPO_ROOT = Path(__file__).resolve().parents[2]
ENV = {**{k: v for k, v in os.environ.items() if k not in ("HEARTH_NATS_URL", "HEARTH_CONFIG")},
       "OMP_NUM_THREADS": "1", "HEARTH_NATS__INSECURE": "1"}  # an open broker: credentials are not the point here
LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
exit_timeout_s = 120.0


def two_ggufs(tmp_path: Path) -> str:
    folder = tmp_path / "two"
    folder.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (folder / name).write_bytes(b"GGUF")
    return str(folder)


@pytest.mark.parametrize(("model", "why"), [
    (lambda tmp_path: str(tmp_path / "nope.gguf"), "does not exist"),
    (two_ggufs, "holds several GGUF files (a.gguf, b.gguf)"),
    (lambda tmp_path: "store:nobody-published-this", "nothing was published"),
], ids=["missing-path", "two-ggufs", "unpublished-store-name"])
def test_an_unknown_preload_is_one_line_naming_it(model, why, nats_url, tmp_path):
    spec = model(tmp_path)
    completed = subprocess.run([HEARTH, "orchestrator", "--node-id", "bad-preload", "--torch-threads", "1",
                                "--preload", spec, "--nats", nats_url], capture_output=True, text=True, env=ENV,
                               cwd=REPO_ROOT, timeout=exit_timeout_s)
    lines = [line for line in completed.stderr.splitlines() if line.strip() and not LOG_RECORD.match(line)]
    assert completed.returncode == 1, completed.stderr
    assert "Traceback" not in completed.stderr
    assert len(lines) == 1, completed.stderr
    assert lines[0].startswith(f"hearth orchestrator: --preload: unknown model {spec!r}"), lines[0]
    assert why in lines[0], lines[0]


