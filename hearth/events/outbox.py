"""EventOutbox: takes audit events off a caller's critical path: `record` queues an event, one task writes
the queue to JetStream in order, retrying each event until it is stored.

Why: a JetStream publish waits for the server's fsync (and, across a broker restart, for the broker), and a
call must not stream its tokens at that pace. Nothing is dropped while the process lives: the queue is
bounded (`max_queued`), and a full queue makes `record` wait instead. Its depth is the gauge
`hearth_event_outbox_depth` and `depth`. `stop` writes what is left within its deadline and reports (at
ERROR) any event it could not write before the process ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nats.js import JetStreamContext

from hearth.events.metrics import event_outbox_depth
from hearth.events.models import EventEnvelope
from hearth.events.publish import publish_event
from hearth.trust.keys import MemberKey

log = logging.getLogger(__name__)


class EventOutbox:
    """One ordered, bounded queue of events and the task that writes it."""

    def __init__(self, js: JetStreamContext, *, max_queued: int, retry_wait_s: float,
                 publish_delay_s: float = 0.0, signing_key: MemberKey | None = None) -> None:
        self.js = js
        # Events are signed by the writer task, off the caller's path, like the write itself.
        self.signing_key = signing_key
        self.retry_wait_s = retry_wait_s
        # Testing only: every write waits this long first, as a slow or distant broker would make it.
        self.publish_delay_s = publish_delay_s
        self._queue: asyncio.Queue[EventEnvelope] = asyncio.Queue(maxsize=max_queued)
        self._writer: asyncio.Task | None = None
        self._writing: EventEnvelope | None = None

    @property
    def depth(self) -> int:
        """Events recorded and not yet stored (the one being written included)."""
        return self._queue.qsize() + (self._writing is not None)

    def start(self) -> None:
        if self._writer is None:
            self._writer = asyncio.create_task(self._write_forever(), name="event-outbox")

    async def record(self, event: EventEnvelope) -> None:
        """Queue `event` for writing; returns at once unless `max_queued` events are already waiting."""
        await self._queue.put(event)
        event_outbox_depth.set(self.depth)

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every event recorded so far is stored; False when `timeout_s` passed first."""
        if self.depth:
            # One join, cancelled however the wait ends: left running, it would wait for events nobody writes now.
            joined = asyncio.ensure_future(self._queue.join())
            try:
                await asyncio.wait({joined}, timeout=timeout_s)
            finally:
                joined.cancel()
        return self.depth == 0

    async def stop(self, timeout_s: float) -> None:
        """Write what is left within `timeout_s`, then stop the writer."""
        if self._writer is None:
            return
        if not await self.flush(timeout_s):
            log.error("%d audit event(s) not written before shutdown", self.depth)
        self._writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._writer
        self._writer = None

    async def _write_forever(self) -> None:
        while True:
            event = await self._queue.get()
            self._writing = event
            try:
                await self._write(event)
            finally:
                self._writing = None
                self._queue.task_done()
                event_outbox_depth.set(self.depth)

    async def _write(self, event: EventEnvelope) -> None:
        if self.publish_delay_s:
            await asyncio.sleep(self.publish_delay_s)
        failures = 0
        while True:
            try:
                await publish_event(self.js, event, signing_key=self.signing_key)
                return
            except Exception as error:  # publish_event already retried the transient ones; keep the order
                failures += 1
                if failures == 1:
                    log.warning("event %s %s not written yet (%s); retrying until it is", event.type,
                                event.event_id, error)
                await asyncio.sleep(self.retry_wait_s)
