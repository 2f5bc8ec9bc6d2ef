"""Tells a stream that was deleted and created again (a broker whose store was wiped, a steward's re-creation) from
the one a projection's position was taken in, so a projector reads it again from its first message instead of
waiting, silently, for sequences it has already passed.

A stream's sequences never go back and its creation time never changes (not on an update, a restart or a leader
change), so the stream a position was taken in was created before the last message applied from it was stored.
A stream created after that message is another one when its last sequence is below the position, or when its message
at the position was stored at another time; the same messages restored from a backup keep their storage times, and
the position stands.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from datetime import datetime

from hearth.events.consume import read_stream

# `last_event_at` is whole seconds, floored.
_flooring_s = 1


@dataclass(frozen=True)
class StreamState:
    """What the broker says of a stream now."""

    created: datetime | None
    last_seq: int


async def stream_state(js, stream: str) -> StreamState:
    info = await js.stream_info(stream)
    return StreamState(created=info.created, last_seq=int(info.state.last_seq))


def created_after(state: StreamState, last_event_at: int | None) -> bool:
    """Whether the stream was created after the last applied message was stored (the cheap first test)."""
    if state.created is None or last_event_at is None:
        return False
    return math.floor(state.created.timestamp()) > last_event_at + _flooring_s


async def recreated_since(js, stream: str, state: StreamState, position: int,
                          last_event_at: int | None) -> str | None:
    """Why `stream` (as `state` says it is now) is not the stream `position` was applied from, or None when it is
    (or when nothing says otherwise: no position, no time of the last applied message)."""
    if position <= 0 or not created_after(state, last_event_at):
        return None
    if state.last_seq < position:
        return f"created at {state.created:%Y-%m-%d %H:%M:%S} UTC, its last sequence is {state.last_seq}"
    stored_at = await _stored_at(js, stream, position)
    # The same messages restored, or none left at the position to tell by (the stream's limits removed it).
    if stored_at is None or math.floor(stored_at.timestamp()) == last_event_at:
        return None
    return f"created at {state.created:%Y-%m-%d %H:%M:%S} UTC, its message {position} is another one"


async def _stored_at(js, stream: str, seq: int) -> datetime | None:
    """When the stream stored its message `seq` (None: it holds none there), read through a consumer: readers may
    not get messages directly."""
    async with contextlib.aclosing(read_stream(js, stream, from_seq=seq, to_seq=seq)) as reading:
        async for message in reading:
            return message.time if message.seq == seq else None
    return None
