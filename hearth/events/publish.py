"""Publishes one event to JetStream with its event_id as `Nats-Msg-Id`, signed by the emitting member's key
when it has one, retrying transient failures (never through a connection that is away: `_until_connected`)."""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import PubAck
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from hearth.events.cancellation import keeping_cancellation
from hearth.events.metrics import events_published_total
from hearth.events.models import EventEnvelope, encode_event
from hearth.events.ordered_reader import core_client
from hearth.events.signing import sign_event
from hearth.protocol.subjects import event_subject
from hearth.trust.keys import MemberKey

log = logging.getLogger(__name__)

MSG_ID_HEADER = "Nats-Msg-Id"
publish_timeout_s = 5.0
publish_max_attempts = 5
publish_total_deadline_s = 30.0
publish_retry_initial_wait_s = 0.1
publish_retry_max_wait_s = 2.0
# How often an attempt waiting for the connection to come back looks again.
reconnect_poll_interval_s = 0.05

# Worth retrying: the same Nats-Msg-Id makes a retry of an event that was in fact stored a no-op.
# NoStreamResponseError: JetStream is restarting or the stream is being (re)created.
TRANSIENT_PUBLISH_ERRORS: tuple[type[BaseException], ...] = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)


async def publish_event(
    js: JetStreamContext,
    event: EventEnvelope,
    *,
    subject: str | None = None,
    timeout_s: float = publish_timeout_s,
    max_attempts: int = publish_max_attempts,
    signing_key: MemberKey | None = None,
    retry_log_level: int = logging.WARNING,
) -> PubAck:
    """Publish `event` on its subject (or `subject`) and return the ack; `ack.duplicate` marks a dropped re-publish.
    With `signing_key` (a community member's) the event goes out signed by it; without, unsigned. Each retry is
    logged at `retry_log_level`: a caller that says itself that its events are not stored (a stream that takes none
    for minutes) passes DEBUG, so its log does not fill with every attempt."""
    if signing_key is not None:
        event = sign_event(event, signing_key)
    target = subject or event_subject(event)
    payload = encode_event(event)
    headers = {MSG_ID_HEADER: event.event_id}

    def log_retry(state: RetryCallState) -> None:
        log.log(
            retry_log_level,
            "publishing %s %s to %s failed (%s); attempt %d of %d in %.2f s",
            event.type, event.event_id, target, state.outcome.exception(),  # type: ignore[attr-defined]
            state.attempt_number + 1, max_attempts, state.next_action.sleep if state.next_action else 0.0,
        )

    connection = core_client(js)
    retrying = AsyncRetrying(
        retry=retry_if_exception_type(TRANSIENT_PUBLISH_ERRORS),
        stop=stop_after_attempt(max_attempts) | stop_after_delay(publish_total_deadline_s),
        wait=wait_exponential(multiplier=publish_retry_initial_wait_s, max=publish_retry_max_wait_s),
        before_sleep=log_retry,
        reraise=True,
    )
    async for attempt in retrying:
        with attempt:
            await _until_connected(connection, timeout_s)
            ack = await keeping_cancellation(js.publish(target, payload, timeout=timeout_s, headers=headers))
    events_published_total.labels(type=event.type).inc()  # type: ignore[attr-defined]
    return ack


async def _until_connected(connection, timeout_s: float) -> None:
    """Return once `connection` is not reconnecting; ConnectionReconnectingError after `timeout_s`. An event is never
    handed to a connection that is away: it would hold the request and send it at the reconnect, perhaps past the
    stream's duplicate window after an earlier try that was stored, and that copy would be kept too."""
    deadline = time.monotonic() + timeout_s
    while connection.is_reconnecting:
        if time.monotonic() >= deadline:
            raise nats.errors.ConnectionReconnectingError
        await asyncio.sleep(reconnect_poll_interval_s)
