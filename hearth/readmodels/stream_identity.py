"""Tells a stream that was deleted and created again (a broker whose store was wiped, a steward's re-creation) from
the one a projection's position was taken in, so a projector reads it again from its first message instead of
waiting, silently, for sequences it has already passed.

A stream is known by its creation time, which the broker keeps unchanged across updates, restarts, scaling and
leader changes; the read model records it with the position (projection_positions.stream_created). A position
recorded before that (or in a database migrated to it) takes the stream it next sees for its own. A stream created
again that holds the same messages (a backup restored) keeps its messages' storage times: when its message at the
position was stored at the time the position records, the position stands and the new creation time is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Literal

from hearth.events.consume import read_stream
from hearth.events.streams import stream_info_timeout_s

Verdict = Literal["its_own", "unrecorded", "restored", "recreated"]


@dataclass(frozen=True)
class StreamState:
    """What the broker says of a stream now: its creation time (ISO 8601, UTC) and last sequence."""

    created: str | None
    last_seq: int


async def stream_state(js, stream: str) -> StreamState:
    info = await js.stream_info(stream)
    created = info.created.astimezone(timezone.utc).isoformat() if info.created is not None else None
    return StreamState(created=created, last_seq=int(info.state.last_seq))


async def judge(js, stream: str, state: StreamState, *, position: int, recorded: str | None,
                last_event_at: int | None) -> Verdict:
    """Whether `stream` as `state` says is the one `position` was taken in: `its_own` (nothing to do),
    `unrecorded` (no creation time recorded yet: it is taken for its own, to be recorded), `restored` (another
    creation time, the same messages: the new time to be recorded) or `recreated` (to be read from its start)."""
    if position <= 0 or state.created is None or state.created == recorded:
        return "its_own"
    if recorded is None:
        return "unrecorded"
    if state.last_seq >= position and last_event_at is not None:
        stored_at = await _stored_at(js, stream, position)
        if stored_at is not None and math.floor(stored_at.timestamp()) == last_event_at:
            return "restored"
    return "recreated"


async def is_its_own_stream(js, stream: str, *, position: int, recorded: str | None) -> bool:
    """False when `stream` is, as far as the broker says, not the one `position` was taken in (a follower then
    waits for the projector to read it again from its start)."""
    if recorded is None or position <= 0:
        return True
    try:
        state = await asyncio.wait_for(stream_state(js, stream), timeout=stream_info_timeout_s)
    except Exception:  # reading would fail the same way, and is tried again
        return True
    return state.created in (None, recorded)


async def _stored_at(js, stream: str, seq: int) -> datetime | None:
    """When the stream stored its message `seq` (None: it holds none there), read through a consumer: readers may
    not get messages directly."""
    async with contextlib.aclosing(read_stream(js, stream, from_seq=seq, to_seq=seq)) as reading:
        async for message in reading:
            return message.time if message.seq == seq else None
    return None
