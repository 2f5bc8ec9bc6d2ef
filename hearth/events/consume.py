"""Reads events back from JetStream in stream order (projector, replay, rebuild) without leaving a consumer behind.

`read_stream` reads through events.ordered_reader.OrderedPushReader (our own ordered push consumer; its
module says why nats-py's is not used), so the caller sees every stored message exactly once and in
order, across consumer losses and nats-server restarts, and no consumer stays behind once the iterator
is closed.

Messages that do not decode into an event are logged, counted in `hearth_events_undecodable_total`
and yielded as `SkippedMessage`, so a reader can still move its position past them. One only a newer hearth reads is
logged once a while per type and version (events.newer_hearth), not once per message, and carries what it says of
itself (`newer`), for a projection to keep it as rejected.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime

from nats.js import JetStreamContext
from pydantic import ValidationError

from hearth.events.cancellation import keeping_cancellation
from hearth.events.metrics import events_undecodable_total
from hearth.events.models import Event, decode_event
from hearth.events.newer_hearth import EventOfANewerHearth, NewerHearthEvent, NewerHearthNotices
from hearth.events.ordered_reader import OrderedPushReader, StreamReadStalled
from hearth.protocol.bounded_values import cut_text
from hearth.protocol.bounds import max_reason_chars

__all__ = [
    "SkippedMessage",
    "StoredEvent",
    "StreamReadStalled",
    "decode_stored_message",
    "read_stream",
    "stream_last_seq",
]

log = logging.getLogger(__name__)

# Streams number their messages from 1.
first_stream_seq = 1
# Without --follow: give up (StreamReadStalled) when no expected message arrives for this long.
default_idle_timeout_s = 15.0
_as_text = cut_text(max_reason_chars)
# Every reader of this process tells of a newer hearth's events through one memory of what it told.
newer_hearth_notices = NewerHearthNotices()


@dataclass(frozen=True)
class StoredEvent:
    """A decoded event with its place in the log (`time` is when the server stored it)."""

    stream: str
    seq: int
    subject: str
    time: datetime
    headers: dict[str, str]
    event: Event
    # The body as stored: its signature is checked over these bytes (hearth/events/signing.py), so fields this code
    # does not know yet (a newer emitter's) are covered too. Empty when the event was not read from a stream.
    data: bytes = b""


@dataclass(frozen=True)
class SkippedMessage:
    """A message on an event subject that did not decode; it has been logged and counted."""

    stream: str
    seq: int
    subject: str
    time: datetime
    error: str
    # An event only a newer hearth reads (a type or version past this one's), as it describes itself; None: junk.
    newer: NewerHearthEvent | None = None
    # Such an event's body as stored, which its signature is checked over (hearth/readmodels/admission.py); empty
    # for junk.
    data: bytes = b""


async def stream_last_seq(js: JetStreamContext, stream: str) -> int:
    """The sequence of the newest message in `stream` (0 when it never held one)."""
    info = await keeping_cancellation(js.stream_info(stream))
    return int(info.state.last_seq)


async def read_stream(
    js: JetStreamContext,
    stream: str,
    *,
    from_seq: int = first_stream_seq,
    to_seq: int | None = None,
    subject_filter: str | Sequence[str] | None = None,
    follow: bool = False,
    idle_timeout_s: float = default_idle_timeout_s,
    from_time: datetime | None = None,
) -> AsyncIterator[StoredEvent | SkippedMessage]:
    """Yield the messages of `stream` in sequence order, from `from_seq` (or `from_time`) on.

    Without `follow` the read ends at the stream's last sequence as of the call (or `to_seq`, or the
    last message matching `subject_filter`); with `follow` it keeps waiting for new messages until
    `to_seq` or until the caller stops. `subject_filter` is one NATS subject filter or several.
    Close the iterator (`contextlib.aclosing`) when stopping early, so its consumer is deleted now.
    """
    if from_seq < 1:
        raise ValueError(f"from_seq must be >= 1, got {from_seq}")
    end_seq: float = math.inf if to_seq is None else to_seq
    if not follow:
        end_seq = min(end_seq, await stream_last_seq(js, stream))
        if from_seq > end_seq:
            return
    reader = OrderedPushReader(
        js,
        stream,
        start_seq=from_seq,
        start_time=from_time,
        filters=_as_filter_list(subject_filter),
        follow=follow,
        idle_timeout_s=idle_timeout_s,
    )
    try:
        if not await reader.open():
            return
        while True:
            msg = await reader.next_data_message()
            if msg is None:
                return
            metadata = msg.metadata
            seq = metadata.sequence.stream
            if seq > end_seq:
                return
            yield decode_stored_message(stream, seq, msg.subject, metadata.timestamp, msg.headers, msg.data)
            if seq >= end_seq or (not follow and metadata.num_pending == 0):
                return
    finally:
        await reader.close()


def decode_stored_message(
    stream: str,
    seq: int,
    subject: str,
    stored_at: datetime,
    headers: dict[str, str] | None,
    data: bytes,
) -> StoredEvent | SkippedMessage:
    """Decode one stored message; a failure becomes a logged, counted SkippedMessage, never an exception."""
    try:
        event = decode_event(data)
    except EventOfANewerHearth as refused:
        newer_hearth_notices.skipped(refused.newer, f"{stream}#{seq} on {subject}")
        events_undecodable_total.labels(stream=stream).inc()
        return SkippedMessage(stream=stream, seq=seq, subject=subject, time=stored_at, error=str(refused),
                              newer=refused.newer, data=bytes(data))
    except ValueError as error:  # pydantic's ValidationError too: whatever a body holds, decode_event refuses so
        reason = _short_error(error)
        log.warning("skipping undecodable message %s#%d on %s: %s", stream, seq, subject, reason)
        events_undecodable_total.labels(stream=stream).inc()
        return SkippedMessage(stream=stream, seq=seq, subject=subject, time=stored_at, error=reason)
    return StoredEvent(
        stream=stream, seq=seq, subject=subject, time=stored_at, headers=dict(headers or {}), event=event,
        data=bytes(data),
    )


def _short_error(error: Exception) -> str:
    """What is wrong with a body, as text any log, terminal or file takes: it names the body's own keys, which a JSON
    escape may make lone surrogates (written as `?`)."""
    if isinstance(error, ValidationError):
        problems = "; ".join(
            f"{'.'.join(str(part) for part in item['loc']) or '<root>'}: {item['msg']}"
            for item in error.errors()[:5]
        )
        return _as_text(f"{error.error_count()} validation error(s): {problems}")
    return _as_text(f"{type(error).__name__}: {error}")


def _as_filter_list(subject_filter: str | Sequence[str] | None) -> list[str]:
    if subject_filter is None:
        return []
    if isinstance(subject_filter, str):
        return [subject_filter]
    return list(subject_filter)
