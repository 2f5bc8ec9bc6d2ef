"""A hearth command holds full garbage collections back while it imports, and freezes what it made by the time its
event loop starts; a process that never held them back (this test process, running many loops) is left alone."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading

import pytest

from hearth.services.broker.listen_ports import free_tcp_port
from hearth.services.common import process_gc
from hearth.services.common.lifecycle import run_event_loop


@pytest.fixture
def restored_gc():
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)
    process_gc._held_full_threshold = None


async def nothing() -> None:
    return None


def test_a_loop_in_a_process_that_never_held_collections_back_freezes_nothing(restored_gc):
    thresholds = gc.get_threshold()
    run_event_loop(nothing())
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == thresholds


def test_full_collections_wait_while_starting_and_resume_over_new_objects_once_the_loop_starts(restored_gc):
    young, middle, full = gc.get_threshold()
    process_gc.hold_full_collections()
    assert gc.get_threshold() == (young, middle, process_gc.importing_full_collection_threshold)
    made_while_starting = [[index] for index in range(1000)]
    run_event_loop(nothing())
    assert gc.get_threshold() == (young, middle, full)
    assert gc.get_freeze_count() >= len(made_while_starting)
    frozen = gc.get_freeze_count()
    run_event_loop(nothing())  # a second loop freezes nothing more (frozen objects may still be freed)
    assert gc.get_freeze_count() <= frozen


def test_the_hearth_command_holds_full_collections_back_until_its_loop_starts_and_then_freezes():
    # `hearth chat` against a broker nobody listens on: its loop starts, then the command fails in one line.
    probe = ("import atexit, gc, sys\n"
             "atexit.register(lambda: print('at exit', gc.get_threshold()[2], gc.get_freeze_count() > 0))\n"
             "from hearth.services.cli import main\n"
             "sys.argv = ['hearth', 'chat', '--nats', 'nats://127.0.0.1:' + sys.argv[1], 'Hello']\n"
             "main()\n")
    env = {**os.environ, "HEARTH_NATS__CONNECT_TIMEOUT_S": "0.5", "HEARTH_NATS__INSECURE": "1"}
    completed = subprocess.run([sys.executable, "-c", probe, str(free_tcp_port())], capture_output=True, text=True,
                               env=env, timeout=120)
    assert "cannot reach NATS" in completed.stderr, completed.stderr
    assert completed.stdout.splitlines()[-1] == f"at exit {gc.get_threshold()[2]} True", completed.stdout


def test_hearth_nats_freezes_once_it_serves_without_an_event_loop(restored_gc, tmp_path):
    from hearth.services import nats_cli

    class StoppedServers:
        stopped = False
        store_dir = tmp_path  # where the store's full-disk watch reads the server's log (none here)

        def is_running(self) -> bool:
            return True

        def stop(self) -> None:
            self.stopped = True

    young, middle, full = gc.get_threshold()
    process_gc.hold_full_collections()
    stop_requested = threading.Event()
    stop_requested.set()
    servers = StoppedServers()
    nats_cli._serve_until_stopped(servers, stop_requested, roster_watch=None, sweeper=None)
    assert servers.stopped
    assert gc.get_threshold() == (young, middle, full)
    assert gc.get_freeze_count() > 0
