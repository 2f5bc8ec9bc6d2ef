"""One ordered push consumer on a JetStream stream, recreated from the next needed sequence whenever it breaks.

This is the same recipe as the official clients' "ordered consumer" (ephemeral, in-memory, ack-less,
flow control, idle heartbeats). nats-py 2.16 has one (`js.subscribe(..., ordered_consumer=True)`), but it
does not keep two guarantees that events.consume.read_stream gives its callers, so it is not used:

- it resumes at the last *delivered* stream sequence + 1, which is 0 + 1 before the first delivery: a
  consumer that vanishes (a nats-server restart loses in-memory consumers) before anything was
  delivered is recreated at stream sequence 1, not at `opt_start_seq` / `opt_start_time`, and the
  caller gets every older message again (shown against a real nats-server: started at seq 6, the
  consumer deleted, it then delivered 1, 2, 3, 4, 5, 6);
- neither `unsubscribe()` nor its recreation deletes a consumer: each one stays on the server until
  its inactive threshold, so a closed read leaves consumers behind.

Here, any gap in the consumer sequence, a missed heartbeat, a reconnect (the server may have restarted)
or a deletion notice makes the reader delete its consumer and create a new one from the next stream
sequence it still needs (or the start time, before the first message), so the caller sees every stored
message exactly once and in order; `close()` deletes the consumer. A connection closed for good ends the read
(ConnectionClosedError): no consumer can be made on it again. If the process dies instead, or the reader is closed
while its connection is down (a broker restarting, or refusing the member's key: the delete could only wait its
timeout out), the server drops it after `consumer_inactive_threshold_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from datetime import datetime, timezone

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, ReplayPolicy

from hearth.events.cancellation import keeping_cancellation
from hearth.events.reconnect_notices import listen_for_reconnects, stop_listening

log = logging.getLogger(__name__)

# Heartbeats let us notice a vanished consumer (server restart) within ~3 intervals.
consumer_idle_heartbeat_s = 2.0
missed_heartbeats_before_reset = 3
# How often a quiet reader looks at its connection's reconnect count when the connection does not say when it
# reconnects (events.reconnect_notices); one that says wakes it, and a quiet reader otherwise sleeps until its silence
# limit or idle timeout is due.
quiet_check_interval_s = 0.5
# Safety net for a reader that dies without deleting its consumer.
consumer_inactive_threshold_s = 30.0
jetstream_api_timeout_s = 5.0
consumer_delete_timeout_s = 2.0
recreate_retry_initial_s = 0.25
recreate_retry_max_s = 2.0

_STATUS_HEADER = "Status"
_DESCRIPTION_HEADER = "Description"
_CONSUMER_STALLED_HEADER = "Nats-Consumer-Stalled"
_LAST_CONSUMER_HEADER = "Nats-Last-Consumer"
# Put on a reader's queue when its connection has reconnected: the consumer may be gone with a restarted server.
_RECONNECTED = object()
_CONTROL_STATUS = "100"
_CONFLICT_STATUS = "409"


class StreamReadStalled(TimeoutError):
    """A bounded read (follow=False) saw no expected message for `idle_timeout_s`."""


def core_client(js: JetStreamContext) -> NatsClient:
    """The connection behind `js` (nats-py exposes no public accessor for it)."""
    return js._nc  # noqa: SLF001


class OrderedPushReader:
    """One ordered push consumer at a time on `stream`; recreated from the next needed sequence on any gap."""

    def __init__(
        self,
        js: JetStreamContext,
        stream: str,
        *,
        start_seq: int,
        start_time: datetime | None,
        filters: list[str],
        follow: bool,
        idle_timeout_s: float,
    ) -> None:
        self._js = js
        self._nc = core_client(js)
        self._stream = stream
        self._next_stream_seq = start_seq
        self._start_time = start_time
        self._filters = filters
        self._follow = follow
        self._idle_timeout_s = idle_timeout_s
        # Deliveries are tagged with the consumer generation that received them.
        self._queue: asyncio.Queue[tuple[int, Msg]] = asyncio.Queue()
        self._generation = 0
        self._subscription: Subscription | None = None
        self._consumer_name: str | None = None
        self._expected_consumer_seq = 1
        self._last_activity = time.monotonic()
        self._last_data = time.monotonic()
        self._reconnects_at_creation = 0
        self._waiting_since = time.monotonic()
        self._nothing_left = False
        self._reconnects_told = False

    async def open(self) -> bool:
        """Create the first consumer; False when nothing is there to read and the read is bounded."""
        self._reconnects_told = listen_for_reconnects(self._nc, self._wake_on_reconnect)
        num_pending = await self._create_consumer_retrying()
        return self._follow or num_pending > 0

    def _wake_on_reconnect(self) -> None:
        self._queue.put_nowait((self._generation, _RECONNECTED))

    async def next_data_message(self) -> Msg | None:
        """The next in-order data message (None: a bounded read found nothing left after a reset).

        Handles flow control, heartbeats and consumer resets on the way.
        """
        # Time the caller spent between messages is not silence on the wire.
        self._waiting_since = time.monotonic()
        while True:
            if self._nothing_left:
                return None
            delivery = self._queue.get_nowait() if not self._queue.empty() else await self._wait_for_message()
            if delivery is None:
                continue
            generation, msg = delivery
            if msg is _RECONNECTED:
                await self._recreate_if_reconnected()
                continue
            if generation != self._generation:
                continue  # a late delivery to a consumer we already replaced
            self._last_activity = time.monotonic()
            status = msg.headers.get(_STATUS_HEADER) if msg.headers else None
            if status:
                await self._handle_status(msg, status)
                continue
            try:
                metadata = msg.metadata
            except nats.errors.NotJSMessageError:
                log.debug("ignoring a non-JetStream message on %s", msg.subject)
                continue
            if metadata.sequence.consumer != self._expected_consumer_seq:
                log.info(
                    "%s: consumer sequence gap (got %d, expected %d), resuming at stream seq %d",
                    self._stream, metadata.sequence.consumer, self._expected_consumer_seq,
                    self._next_stream_seq,
                )
                await self._reset()
                continue
            self._expected_consumer_seq += 1
            self._next_stream_seq = metadata.sequence.stream + 1
            self._start_time = None
            self._last_data = self._last_activity
            return msg

    async def _wait_for_message(self) -> tuple[int, Msg] | None:
        """The next delivery, or None once a quiet check was due (and made): the silence limit, a bounded read's idle
        timeout, or (on a connection that does not say when it reconnects) a look at its reconnect count."""
        silence_limit_s = consumer_idle_heartbeat_s * missed_heartbeats_before_reset
        now = time.monotonic()
        due = [max(self._last_activity, self._waiting_since) + silence_limit_s]
        if not self._follow:
            due.append(max(self._last_data, self._waiting_since) + self._idle_timeout_s)
        if not self._reconnects_told:
            due.append(now + quiet_check_interval_s)
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns a message that arrives in the turn a
            # cancellation lands and drops the cancellation, and a follow stopped by a signal would go on reading.
            async with asyncio.timeout(max(0.0, min(due) - now)):
                return await self._queue.get()
        except TimeoutError:
            pass
        now = time.monotonic()
        if not self._follow and now - max(self._last_data, self._waiting_since) >= self._idle_timeout_s:
            raise StreamReadStalled(
                f"no message from {self._stream} for {self._idle_timeout_s} s "
                f"(waiting for stream seq >= {self._next_stream_seq})"
            )
        if (not await self._recreate_if_reconnected()
                and now - max(self._last_activity, self._waiting_since) >= silence_limit_s):
            log.info("%s: no heartbeat for %.1f s, recreating the consumer", self._stream, silence_limit_s)
            await self._reset()
        return None

    async def _recreate_if_reconnected(self) -> bool:
        """Recreate the consumer if the connection reconnected since it was created: the server may have restarted
        and lost it (in memory), and waiting for its heartbeats to stop would take three of them."""
        if self._nc.stats["reconnects"] == self._reconnects_at_creation:
            return False
        log.info("%s: reconnected to NATS, recreating the consumer", self._stream)
        await self._reset()
        return True

    async def _handle_status(self, msg: Msg, status: str) -> None:
        headers = msg.headers or {}
        if status == _CONTROL_STATUS:
            if msg.reply:
                # A flow-control request; everything before it has been taken off the queue.
                await self._nc.publish(msg.reply)
                return
            stalled_reply = headers.get(_CONSUMER_STALLED_HEADER)
            if stalled_reply:
                await self._nc.publish(stalled_reply)
            last_consumer_seq = headers.get(_LAST_CONSUMER_HEADER)
            if last_consumer_seq is not None and int(last_consumer_seq) != self._expected_consumer_seq - 1:
                if int(last_consumer_seq) >= self._expected_consumer_seq:
                    log.info("%s: heartbeat reports missed messages, resetting", self._stream)
                    await self._reset()
            return
        if status == _CONFLICT_STATUS:
            log.info("%s: consumer %s: %s; recreating", self._stream, self._consumer_name,
                     headers.get(_DESCRIPTION_HEADER, "conflict"))
            await self._reset()
            return
        log.debug("%s: ignoring status %s %s", self._stream, status, headers.get(_DESCRIPTION_HEADER, ""))

    async def _reset(self) -> None:
        await self._discard_consumer()
        num_pending = await self._create_consumer_retrying()
        # E.g. the remaining messages expired (max_age) while we were reconnecting.
        self._nothing_left = not self._follow and num_pending == 0

    async def _create_consumer_retrying(self) -> int:
        """Create a fresh consumer from the next needed sequence; returns its num_pending."""
        wait_s = recreate_retry_initial_s
        first_failure_at: float | None = None
        while True:
            try:
                return await self._create_consumer()
            except (nats.errors.Error, asyncio.TimeoutError) as error:
                if self._nc.is_closed:  # closed for good: no later try can pass
                    raise nats.errors.ConnectionClosedError from error
                now = time.monotonic()
                first_failure_at = first_failure_at or now
                if not self._follow and now - first_failure_at > self._idle_timeout_s:
                    raise StreamReadStalled(f"cannot create a consumer on {self._stream}: {error}") from error
                log.warning("%s: creating a consumer failed (%s); retrying in %.2f s", self._stream, error, wait_s)
                await asyncio.sleep(wait_s)
                wait_s = min(wait_s * 2, recreate_retry_max_s)

    async def _create_consumer(self) -> int:
        reconnects = self._nc.stats["reconnects"]
        inbox = self._nc.new_inbox()
        name = f"hearth-read-{uuid.uuid4().hex[:16]}"
        queue = self._queue
        self._generation += 1
        generation = self._generation

        async def enqueue(msg: Msg) -> None:
            queue.put_nowait((generation, msg))

        # Subscribe before creating the consumer, so no delivery can precede our interest.
        subscription = await self._nc.subscribe(inbox, cb=enqueue)
        config = ConsumerConfig(
            name=name,
            deliver_subject=inbox,
            ack_policy=AckPolicy.NONE,
            max_deliver=1,
            flow_control=True,
            idle_heartbeat=consumer_idle_heartbeat_s,
            mem_storage=True,
            num_replicas=1,
            inactive_threshold=consumer_inactive_threshold_s,
            replay_policy=ReplayPolicy.INSTANT,
        )
        if self._start_time is not None:
            config.deliver_policy = DeliverPolicy.BY_START_TIME
            config.opt_start_time = self._start_time.astimezone(timezone.utc)
        else:
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = self._next_stream_seq
        if len(self._filters) == 1:
            config.filter_subject = self._filters[0]
        elif self._filters:
            config.filter_subjects = list(self._filters)
        try:
            info = await keeping_cancellation(
                self._js.add_consumer(self._stream, config=config, timeout=jetstream_api_timeout_s))
        except BaseException:
            await _quietly(subscription.unsubscribe())
            raise
        self._subscription = subscription
        self._consumer_name = info.name
        self._expected_consumer_seq = 1
        self._reconnects_at_creation = reconnects
        self._last_activity = time.monotonic()
        self._last_data = self._last_activity
        log.debug("%s: consumer %s from seq %d", self._stream, info.name, self._next_stream_seq)
        return int(info.num_pending or 0)

    async def _discard_consumer(self) -> None:
        subscription, self._subscription = self._subscription, None
        name, self._consumer_name = self._consumer_name, None
        if subscription is not None:
            await _quietly(subscription.unsubscribe())
        while not self._queue.empty():
            self._queue.get_nowait()
        if name is not None and self._nc.is_connected:
            try:
                async with asyncio.timeout(consumer_delete_timeout_s):
                    await keeping_cancellation(self._js.delete_consumer(self._stream, name))
            except (nats.errors.Error, TimeoutError) as error:
                # It is in-memory and ack-less: the server drops it after the inactive threshold.
                log.debug("%s: could not delete consumer %s: %s", self._stream, name, error)

    async def close(self) -> None:
        stop_listening(self._nc, self._wake_on_reconnect)
        await self._discard_consumer()


async def _quietly(awaitable) -> None:
    try:
        await awaitable
    except (nats.errors.Error, asyncio.TimeoutError):
        pass
