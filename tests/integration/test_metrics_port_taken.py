"""A long-running process asked to serve /metrics on a port another process holds ends in one line naming the port,
exit 1, with no traceback (the projector stands for every process: they share serve_process_metrics)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

HEARTH = str(Path(sys.executable).parent / "hearth")
ENV = {**{k: v for k, v in os.environ.items() if k not in ("HEARTH_NATS_URL", "HEARTH_CONFIG")},
       "HEARTH_NATS__INSECURE": "1"}


def test_a_taken_metrics_port_ends_the_projector_in_one_line(nats_url, tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        completed = subprocess.run([HEARTH, "projector", "--db", str(tmp_path / "read.sqlite"), "--nats", nats_url,
                                    "--metrics-port", str(port)], capture_output=True, text=True, env=ENV, timeout=60)
    assert completed.returncode == 1, completed.stderr
    assert "Traceback" not in completed.stderr
    refusal = [line for line in completed.stderr.splitlines() if line.startswith("hearth projector: ")]
    assert len(refusal) == 1 and f"--metrics-port {port}" in refusal[0], completed.stderr
