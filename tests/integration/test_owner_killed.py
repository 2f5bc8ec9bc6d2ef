"""A process that starts a mesh on one machine (`hearth demo`, a test) and is killed with SIGKILL leaves nothing of
it running: its nats-server and its hearth processes, forked by the prefork launcher or started fresh, end too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

owner_start_timeout_s = 180.0
orphans_end_timeout_s = 30.0

OWNER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from hearth.services.devtools.local_cluster import LocalCluster

    work_dir = Path(sys.argv[1])
    cluster = LocalCluster(work_dir=work_dir, prefork=sys.argv[2] == "1", secure=False, start_new_session=True,
                           metrics=False)
    cluster.start_nats()
    projector = cluster.start_projector(work_dir / "read.db")
    print(cluster.nats.pid, projector.popen.pid, flush=True)
    time.sleep(600)
""")


def command_line(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None


@pytest.mark.parametrize("prefork", [True, False], ids=["prefork", "fresh"])
def test_a_killed_owner_leaves_no_broker_and_no_hearth_process_behind(tmp_path, prefork):
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path / "mesh"), "1" if prefork else "0"],
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    children: dict[int, bytes | None] = {}
    try:
        line = owner.stdout.readline()
        assert line, f"the owner exited with {owner.wait(timeout=owner_start_timeout_s)} before its mesh started"
        children = {int(pid): None for pid in line.split()}
        children = {pid: command_line(pid) for pid in children}
        assert all(children.values()), children
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=orphans_end_timeout_s)
        deadline = time.monotonic() + orphans_end_timeout_s
        while time.monotonic() < deadline and any(command_line(pid) == seen for pid, seen in children.items()):
            time.sleep(0.1)
        left = [seen.replace(b"\0", b" ").decode()[:120] for pid, seen in children.items()
                if command_line(pid) == seen]
        assert left == [], "still running after their owner was killed"
    finally:
        owner.kill()
        owner.wait(timeout=orphans_end_timeout_s)
        for pid, seen in children.items():
            if seen is not None and command_line(pid) == seen:
                os.kill(pid, signal.SIGKILL)
