"""EventOutbox: takes audit events off a caller's critical path: `record` queues an event, one task writes
the queue to JetStream in order, retrying each event until it is stored.

Why: a JetStream publish waits for the server's fsync (and, across a broker restart, for the broker), and a
call must not stream its tokens at that pace. Nothing is dropped while the process lives: the queue is
bounded (`max_queued`), and a full queue makes `record` wait instead. Its depth is the gauge
`hearth_event_outbox_depth` and `depth`. `stop` writes what is left within its deadline and reports (at
ERROR) any event it could not write before the process ends.

Nothing is stored twice either: a write that failed may have been stored all the same (its ack lost when the
broker went down right after storing it), and the server drops a re-publish of the same `Nats-Msg-Id` only within
the stream's duplicate window, so a retry later than `unchecked_retry_horizon_s` first looks for the event in the
stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.js import JetStreamContext

from hearth.events.consume import StoredEvent, read_stream
from hearth.events.metrics import event_outbox_depth
from hearth.events.models import EventEnvelope
from hearth.events.publish import MSG_ID_HEADER, publish_event, publish_timeout_s, publish_total_deadline_s
from hearth.events.streams import duplicate_window_s, stream_for_subject
from hearth.protocol.subjects import event_subject
from hearth.trust.keys import MemberKey

log = logging.getLogger(__name__)

# Past this long after an event's first write, a retry may come more than the duplicate window after an earlier try
# that was stored (one publish_event call retries up to its deadline plus one timeout): it looks in the stream first.
unchecked_retry_horizon_s = duplicate_window_s - publish_total_deadline_s - publish_timeout_s


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
        first_try_at = time.monotonic()
        failures = 0
        while True:
            try:
                if (failures and time.monotonic() - first_try_at > unchecked_retry_horizon_s
                        and await self._stored_already(event)):
                    log.info("event %s %s was stored by an earlier try", event.type, event.event_id)
                    return
                await publish_event(self.js, event, signing_key=self.signing_key)
                return
            except Exception as error:  # publish_event already retried the transient ones; keep the order
                failures += 1
                if failures == 1:
                    log.warning("event %s %s not written yet (%s); retrying until it is", event.type,
                                event.event_id, error)
                await asyncio.sleep(self.retry_wait_s)

    async def _stored_already(self, event: EventEnvelope) -> bool:
        """Whether the stream holds `event`, read from its subject's events (one kind of one pipeline's: a few)."""
        subject = event_subject(event)
        async with contextlib.aclosing(read_stream(self.js, stream_for_subject(subject),
                                                   subject_filter=subject)) as stored:
            async for item in stored:
                if isinstance(item, StoredEvent) and item.headers.get(MSG_ID_HEADER) == event.event_id:
                    return True
        return False
