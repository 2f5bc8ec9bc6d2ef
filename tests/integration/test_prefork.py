"""The prefork launcher's children are real, separate hearth processes: their own pid, parent, environment,
working folder, log and exit status, killable with real signals; a failing command's status and message reach
LocalCluster as a fresh process's would."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from hearth.services.devtools.local_cluster import PREFORK_ENV, ClusterError, LocalCluster, prefork_from_environment
from hearth.services.broker.listen_ports import free_tcp_port
from hearth.services.devtools.prefork import PreforkedProcess, SpawnRequest, import_environment, prefork_launcher

REPO_ROOT = Path(__file__).resolve().parents[2]
exit_timeout_s = 30.0


def _proc_field(pid: int, field: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"/proc/{pid}/status has no {field}")


@pytest.fixture
def cluster(tmp_path):
    with LocalCluster(work_dir=tmp_path / "cluster", prefork=True, secure=False) as local:
        local.start_nats()
        yield local


def test_a_forked_command_is_its_own_process_and_stops_on_sigterm(cluster, tmp_path):
    projector = cluster.start_projector(tmp_path / "read.db")
    popen = projector.popen
    assert isinstance(popen, PreforkedProcess)
    assert popen.pid != os.getpid()
    # Its parent is the launcher, not this test: a fork of a process that imported torch once.
    parent = int(_proc_field(popen.pid, "PPid"))
    assert parent not in (os.getpid(), 1)
    assert Path(f"/proc/{popen.pid}/cwd").resolve() == REPO_ROOT
    # It runs the projector: the read model gets its schema, and the log says what it does.
    database = tmp_path / "read.db"
    deadline = time.monotonic() + exit_timeout_s
    while not database.exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # the projector writes no ready file; its database appears once it runs
    assert database.exists(), projector.log_tail()
    # ps shows the command it runs, not the launcher's.
    command_line = Path(f"/proc/{popen.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    assert "hearth.services.cli" in command_line and "projector --db" in command_line, command_line
    assert projector.alive
    # It ignores SIGPIPE, as every Python interpreter does from its start: a write to a socket its peer closed
    # raises BrokenPipeError instead of killing it (one demo's projector exited with -13 before this).
    assert int(_proc_field(popen.pid, "SigIgn"), 16) & (1 << (signal.SIGPIPE - 1))
    popen.send_signal(signal.SIGTERM)
    assert popen.wait(timeout=exit_timeout_s) == 0, projector.log_tail()
    assert not projector.alive


def test_sigkill_reports_the_signal_and_each_child_has_its_own_pid(cluster, tmp_path):
    first = cluster.start_projector(tmp_path / "one.db")
    second = cluster._spawn("projector-two", ["projector", "--db", str(tmp_path / "two.db")],
                            writes_ready_file=False)
    assert first.popen.pid != second.popen.pid
    assert _proc_field(first.popen.pid, "PPid") == _proc_field(second.popen.pid, "PPid")
    second.popen.kill()
    assert second.popen.wait(timeout=exit_timeout_s) == -signal.SIGKILL
    assert first.alive  # one child's death is not its sibling's
    assert first.stop() == 0


def test_a_failing_command_exits_with_its_status_and_message(cluster, tmp_path):
    with pytest.raises(ClusterError) as refused:
        cluster.start_shard(str(tmp_path / "no-such-model"), 0, 1, node_id="host0")
    assert "exited with 2" in str(refused.value)  # a model that is not there: bad input
    assert "no-such-model" in str(refused.value)
    # Only what the command printed, as from a fresh process: no warning of the fork's own start above its line.
    assert "RuntimeWarning" not in str(refused.value), refused.value


def test_the_child_runs_with_the_environment_it_was_given_not_the_launchers(tmp_path):
    launcher_port, child_port = free_tcp_port(), free_tcp_port()
    base = {**os.environ, "HEARTH_NATS__CONNECT_TIMEOUT_S": "1"}
    launcher = prefork_launcher({**base, "HEARTH_NATS_URL": f"nats://127.0.0.1:{launcher_port}"}, REPO_ROOT)
    log_path = tmp_path / "models.log"
    child = launcher.spawn(SpawnRequest(
        argv=["models", "--insecure"], env={**base, "HEARTH_NATS_URL": f"nats://127.0.0.1:{child_port}"},
        cwd=str(tmp_path), log_path=str(log_path)))
    # `hearth models` exits 2 when no answer came, saying which broker it could not reach.
    assert child.wait(timeout=exit_timeout_s) == 2
    log = log_path.read_text()
    assert f"cannot reach NATS at nats://127.0.0.1:{child_port}" in log, log


def test_launchers_are_shared_per_import_environment(tmp_path):
    base = {key: value for key, value in os.environ.items()}
    same = prefork_launcher({**base, "HEARTH_SOMETHING": "a"}, REPO_ROOT)
    again = prefork_launcher({**base, "HEARTH_SOMETHING": "b"}, REPO_ROOT)
    other = prefork_launcher({**base, "OMP_NUM_THREADS": "1" if base.get("OMP_NUM_THREADS") != "1" else "2"},
                             REPO_ROOT)
    assert same is again  # hearth settings are read when the command runs, after the fork
    assert other is not same  # OpenMP reads its settings while torch is imported: another launcher
    assert import_environment({"OMP_NUM_THREADS": "1", "HEARTH_X": "y"}) == (("OMP_NUM_THREADS", "1"),)


@pytest.mark.parametrize(("value", "default", "expected"),
                         [("", True, True), ("", False, False), ("0", True, False), ("1", False, True),
                          ("no", True, False), ("yes", False, True)])
def test_hearth_prefork_overrides_the_default_only_when_set(monkeypatch, value, default, expected):
    # `hearth demo` forks by default and HEARTH_PREFORK=0 turns it off; LocalCluster elsewhere starts fresh.
    monkeypatch.setenv(PREFORK_ENV, value)
    assert prefork_from_environment(default=default) is expected
