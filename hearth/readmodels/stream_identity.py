"""Tells a stream that was deleted and created again (a broker whose store was wiped, a steward's re-creation) from
the one a projection's position was taken in, so a projector says so instead of waiting in silence for sequences it
has already passed (or applying the new stream's messages past its position as if they followed the old ones).

A stream is known by its creation time, which the broker keeps unchanged across updates, restarts, scaling and
leader changes; the read model records it with the position (projection_positions.stream_created). A fresh
position is taken in the stream as the projector saw it before reading anything of it; a position recorded before
that column existed (a database migrated to it) takes the stream it next sees for its own.

A projector does not move its position back by itself: messages of the new stream may already have been applied
under the old position (its reader takes up a stream of the same name again after a gap), and a stream restored
from a backup under a new creation time holds the very messages applied, so only a rebuild from the log as it is
now gives the rows it holds (`hearth-replay rebuild`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timezone


@dataclass(frozen=True)
class StreamState:
    """What the broker says of a stream now: its creation time (ISO 8601, UTC) and last sequence."""

    created: str | None
    last_seq: int


async def stream_state(js, stream: str) -> StreamState:
    info = await js.stream_info(stream)
    created = info.created.astimezone(timezone.utc).isoformat() if info.created is not None else None
    return StreamState(created=created, last_seq=int(info.state.last_seq))


def replaced(state: StreamState, *, position: int, recorded: str | None) -> bool:
    """Whether the stream `state` describes is not the one `position` was taken in (created at `recorded`)."""
    return position > 0 and state.created is not None and recorded is not None and state.created != recorded
