"""A `hearth` command turns core dumps off first thing (soft and hard limit 0), so that a crash writes none of the
prompts, answers, activations or keys it holds to disk, whatever `ulimit -c` it was started under."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPORT_LIMIT = """
import resource, sys
from hearth.services.cli import main
sys.argv = ["hearth", "docs", "--help"]
try:
    main()
except SystemExit:
    pass
print("core limit", *resource.getrlimit(resource.RLIMIT_CORE))
"""


def _allow_core_dumps() -> None:
    """In the child, before it runs: cores as large as the hard limit allows (a shell's `ulimit -c unlimited`)."""
    _, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_CORE)[1] == 0, reason="core dumps are off for this machine")
def test_a_hearth_command_may_dump_no_core():
    completed = subprocess.run([sys.executable, "-c", REPORT_LIMIT], capture_output=True, text=True, timeout=120,
                               cwd=ROOT, preexec_fn=_allow_core_dumps)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.splitlines()[-1] == "core limit 0 0"
