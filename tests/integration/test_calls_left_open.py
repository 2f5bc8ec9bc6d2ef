"""Calls an orchestrator left open when it was killed (SIGKILL, the OOM killer, a power cut) are closed: the next
orchestrator of its node records `pipeline.aborted` (`orchestrator_gone`) for each, once, after what the killed one
left in its outbox, so no call reads as still streaming in the read models for ever (docs/design.md §3, "Nothing is
lost when the process is killed")."""

from __future__ import annotations

import contextlib

import nats
import pytest

from hearth.events.consume import StoredEvent, read_stream
from hearth.events.streams import PIPELINES_STREAM
from hearth.services.common.config import HearthSettings
from hearth.services.orchestrator.service import Orchestrator
from tests.integration.outbox_process import OWNER
from tests.integration.test_event_outbox_kill import outbox_process

pytestmark = pytest.mark.integration


async def stored_events(url: str) -> list[tuple[str, str, str | None]]:
    """(pipeline_id, type, code) of every event the pipelines stream holds, in order."""
    nc = await nats.connect(url)
    try:
        async with contextlib.aclosing(read_stream(nc.jetstream(), PIPELINES_STREAM)) as items:
            return [(item.event.pipeline_id, item.event.type, getattr(item.event, "code", None))
                    async for item in items if isinstance(item, StoredEvent)]
    finally:
        await nc.close()


async def start_and_stop_an_orchestrator(url: str, folder) -> None:
    nc = await nats.connect(url)
    orchestrator = Orchestrator(nc, HearthSettings(nats={"url": url}), node_id=OWNER, outbox_dir=folder)
    try:
        await orchestrator.start()
    finally:
        await orchestrator.stop()
        await nc.close()


async def test_the_calls_a_killed_orchestrator_left_open_are_aborted_once_by_the_next(nats_server, tmp_path):
    folder = tmp_path / "event-outbox"
    with outbox_process(nats_server.url, folder) as killed:
        assert killed.tell("open 3 1").startswith("recorded")  # p-1, p-2, p-3 begun
        assert killed.tell("record 1 2").startswith("recorded")  # p-2 ended
        assert killed.tell("flush") == "flushed 0"
        killed.kill()  # p-1 and p-3 were under way

    await start_and_stop_an_orchestrator(nats_server.url, folder)
    await start_and_stop_an_orchestrator(nats_server.url, folder)  # a second restart closes nothing more

    events = await stored_events(nats_server.url)
    aborted = [(pipeline, code) for pipeline, kind, code in events if kind == "pipeline.aborted"]
    assert aborted == [("p-1", "orchestrator_gone"), ("p-3", "orchestrator_gone")], events
    assert [kind for pipeline, kind, _ in events if pipeline == "p-2"] == ["pipeline.constructed",
                                                                         "pipeline.completed"]
