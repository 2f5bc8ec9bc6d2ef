"""Reading a mesh's event log in e2e tests: a stream's events, a pipeline's, and waiting for one to be stored."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from nats.aio.client import Client as NatsClient

from hearth.events.consume import StoredEvent, read_stream
from hearth.events.streams import PIPELINES_STREAM

event_wait_timeout_s = 15.0


async def read_events(nc: NatsClient, stream: str,
                      subject_filter: str | list[str] | None = None) -> list[StoredEvent]:
    js = nc.jetstream()
    async with contextlib.aclosing(read_stream(js, stream, subject_filter=subject_filter)) as items:
        return [item async for item in items if isinstance(item, StoredEvent)]


async def pipeline_events(nc: NatsClient, pipeline_id: str, *, ended: bool = True) -> list[StoredEvent]:
    """The pipeline's events; with `ended`, once its final event (completed or aborted) is stored: audit events
    are written after the call's frames (hearth/events/outbox.py), so the last frame can arrive before them."""
    if ended:
        await wait_for_pipeline_end(nc, pipeline_id)
    return await read_events(nc, PIPELINES_STREAM, [f"hearth.events.pipeline.{pipeline_id}.>",
                                                    f"hearth.events.integrity.{pipeline_id}.>"])


async def wait_for_pipeline_end(nc: NatsClient, pipeline_id: str, timeout_s: float = event_wait_timeout_s) -> None:
    def final_event(item: StoredEvent) -> bool:
        event = item.event
        return event.type in ("pipeline.completed", "pipeline.aborted") and event.pipeline_id == pipeline_id

    await wait_for_event(nc, PIPELINES_STREAM, final_event, timeout_s=timeout_s)


async def wait_for_event(nc: NatsClient, stream: str, predicate: Callable[[StoredEvent], bool],
                         timeout_s: float = event_wait_timeout_s) -> StoredEvent:
    """Follow `stream` from its start until an event matches (the match may be stored already)."""
    js = nc.jetstream()

    async def first_match() -> StoredEvent:
        async with contextlib.aclosing(read_stream(js, stream, follow=True)) as items:
            async for item in items:
                if isinstance(item, StoredEvent) and predicate(item):
                    return item
        raise AssertionError("stream ended")

    return await asyncio.wait_for(first_match(), timeout=timeout_s)
