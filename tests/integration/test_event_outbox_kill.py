"""Nothing lost on a kill: a process killed (SIGKILL) with audit events queued while the broker is down leaves them in
its outbox file, and the process started after it writes them, in order and each exactly once, once the broker is
back (hearth/events/outbox.py, hearth/events/outbox_file.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hearth.events.consume import StoredEvent, read_stream
from hearth.events.streams import PIPELINES_STREAM
from hearth.services.broker.connection import connect_nats

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
line_timeout_s = 60.0


class OutboxProcess:
    """tests/integration/outbox_process.py, driven line by line."""

    def __init__(self, nats_url: str, folder: Path) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.outbox_process", nats_url, str(folder)], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)})
        assert self.said() == "ready"

    def said(self) -> str:
        """The process's next line (bounded: a process that says nothing fails the test instead of hanging it)."""
        import selectors

        with selectors.DefaultSelector() as selector:
            selector.register(self.popen.stdout, selectors.EVENT_READ)
            if not selector.select(timeout=line_timeout_s):
                raise AssertionError(f"the outbox process said nothing for {line_timeout_s} s")
        return self.popen.stdout.readline().strip()

    def tell(self, line: str) -> str:
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()
        return self.said()

    def kill(self) -> None:
        os.kill(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=line_timeout_s)

    def end(self) -> None:
        if self.popen.poll() is None:
            self.popen.stdin.close()
            try:
                self.popen.wait(timeout=line_timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()


@contextlib.contextmanager
def outbox_process(nats_url: str, folder: Path) -> Iterator[OutboxProcess]:
    process = OutboxProcess(nats_url, folder)
    try:
        yield process
    finally:
        process.end()


async def stored_pipelines(nats_url: str) -> list[str]:
    nc = await connect_nats(nats_url, name="test-outbox-kill-reader")
    try:
        async with contextlib.aclosing(read_stream(nc.jetstream(), PIPELINES_STREAM)) as items:
            return [item.event.pipeline_id async for item in items if isinstance(item, StoredEvent)]
    finally:
        await nc.close()


async def test_events_queued_by_a_process_killed_while_the_broker_is_down_are_stored_once_after_both_restart(
        nats_server, tmp_path):
    folder = tmp_path / "event-outbox"
    with outbox_process(nats_server.url, folder) as first:
        assert first.tell("record 2 0").startswith("recorded")
        assert first.tell("flush") == "flushed 0"  # p-0, p-1 stored while the broker is up
        await asyncio.to_thread(nats_server.stop)
        assert first.tell("record 5 2") == "recorded 5"  # p-2 .. p-6 queued: the broker is down
        first.kill()
    await asyncio.to_thread(nats_server.start)

    with outbox_process(nats_server.url, folder) as restarted:
        assert restarted.tell("record 1 7").startswith("recorded")  # after what the killed one left
        assert restarted.tell("flush") == "flushed 0"

    assert await stored_pipelines(nats_server.url) == [f"p-{number}" for number in range(8)]
