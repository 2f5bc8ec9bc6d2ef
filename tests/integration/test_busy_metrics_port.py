"""A `--metrics-port` another program holds ends a long-running command with one line naming it and exit code 1,
not a traceback (a second shard started with the first one's port, say)."""

from __future__ import annotations

import socket
import subprocess

import pytest

from tests.integration.test_cli_faults import ENV, REPO_ROOT, command_args, needs_model

pytestmark = pytest.mark.integration
command_timeout_s = 120


@needs_model
@pytest.mark.parametrize("command", ["shard", "orchestrator", "projector"])
def test_a_metrics_port_in_use_is_one_line_and_a_failure(command, nats_url, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        completed = subprocess.run([*command_args(command, nats_url, tmp_path), "--metrics-port", str(port)],
                                   capture_output=True, text=True, cwd=REPO_ROOT, env=ENV, timeout=command_timeout_s)
    assert completed.returncode == 1, completed.stderr
    refusal = f"hearth {command}: --metrics-port {port}: cannot listen on 127.0.0.1:{port}: "
    assert refusal in completed.stderr, completed.stderr
    assert "Traceback" not in completed.stderr, completed.stderr
