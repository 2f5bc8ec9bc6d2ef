"""`hearth nats` keeps its JetStream store folder to itself while its nats-server runs: a second broker on the same
folder (a single server, a `--cluster` node, a `--node`, a `--check`) is refused in one line naming the folder and
the holder, and a broker killed with SIGKILL leaves no lock behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hearth.services.broker.listen_ports import free_tcp_port
from hearth.services.broker.store_lock import StoreFolderLock
from hearth.services.common.child_processes import process_alive
from hearth.trust.community import Community
from tests.integration.test_cli_faults import non_log_lines
from tests.integration.test_hearth_cli import BIN, ENV, _publish_and_count, start_hearth_nats

pytestmark = pytest.mark.integration

PROCESS_ENDS_WITHIN_S = 15.0


def hearth_nats(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "hearth"), "nats", *args], capture_output=True, text=True, timeout=60, env=ENV)


def assert_refused_in_one_line(result: subprocess.CompletedProcess, folder: Path, holder: int) -> None:
    assert result.returncode == 1, result.stderr
    assert result.stdout == "", result.stdout  # no URL: nothing serves
    assert non_log_lines(result.stderr) == [
        f"hearth nats: the store folder {folder} is in use by another broker (held by process {holder}); two "
        "nats-servers writing one store corrupt it: stop that broker, or give this one another store folder"]


def children_of(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def wait_until_ended(pid: int) -> None:
    deadline = time.monotonic() + PROCESS_ENDS_WITHIN_S
    while process_alive(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.05)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=PROCESS_ENDS_WITHIN_S)


def test_a_second_broker_on_the_same_store_is_refused_and_the_first_serves_on(tmp_path):
    store, port = tmp_path / "store", free_tcp_port()
    first, url = start_hearth_nats(port, store)
    try:
        assert asyncio.run(_publish_and_count(url, 2)) == 2
        second = hearth_nats("--port", str(free_tcp_port()), "--store", str(store))
        assert_refused_in_one_line(second, store, first.pid)
        # The refused one wrote nothing into the folder: the configuration is still the first one's.
        assert f":{port}\"" in (store / "hearth-nats.conf").read_text()
        assert first.poll() is None
        assert asyncio.run(_publish_and_count(url, 1)) == 3
        # Nor may a --check rewrite the running broker's configuration.
        assert_refused_in_one_line(hearth_nats("--check", "--port", str(port), "--store", str(store)), store,
                                   first.pid)
    finally:
        stop(first)


def test_a_broker_killed_with_sigkill_leaves_no_lock_that_stops_the_next(tmp_path):
    store, port = tmp_path / "store", free_tcp_port()
    first, url = start_hearth_nats(port, store)
    try:
        assert asyncio.run(_publish_and_count(url, 2)) == 2
        [nats_server] = children_of(first.pid)
        first.kill()
        first.wait(timeout=PROCESS_ENDS_WITHIN_S)
        wait_until_ended(nats_server)  # it ends with its owner (child_processes.py), and holds the lock until then
    finally:
        stop(first)
    second, url = start_hearth_nats(port, store)
    try:
        assert asyncio.run(_publish_and_count(url, 1)) == 3
    finally:
        stop(second)


def test_a_cluster_whose_node_store_is_held_is_refused_naming_that_node_store(tmp_path):
    store = tmp_path / "cluster"
    (store / "nats-1").mkdir(parents=True)
    held = StoreFolderLock(store / "nats-1").take()
    try:
        result = hearth_nats("--cluster", "3", "--port", str(free_tcp_port()), "--cluster-port",
                             str(free_tcp_port()), "--monitor-port", str(free_tcp_port()), "--store", str(store))
        assert_refused_in_one_line(result, store / "nats-1", os.getpid())
        # The node started before it was stopped, and let go of its store.
        StoreFolderLock(store / "nats-0").take().release()
    finally:
        held.release()


def test_a_node_whose_store_is_held_is_refused(tmp_path):
    community = Community.init(tmp_path / "community", "lock-test")
    store = tmp_path / "node"
    store.mkdir()
    held = StoreFolderLock(store).take()
    try:
        result = hearth_nats("--node", "nats-0", "--routes", f"127.0.0.1:{free_tcp_port()}", "--community",
                             str(community.directory), "--port", str(free_tcp_port()), "--store", str(store))
        assert_refused_in_one_line(result, store, os.getpid())
    finally:
        held.release()
