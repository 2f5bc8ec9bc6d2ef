"""Tells a stream that was deleted and created again (a broker whose store was wiped, a steward's re-creation) from
the one a projection's position was taken in, so a projector says so instead of waiting in silence for sequences it
has already passed (or applying the new stream's messages past its position as if they followed the old ones).

A stream is known by its creation time, which the broker keeps unchanged across updates, restarts, scaling and
leader changes; the read model records it with the position (projection_positions.stream_created). A fresh
position is taken in the stream as the projector saw it before reading anything of it, recorded as soon as the position
first moves (`poll_streams`, at once rather than at the next poll); a position recorded before that column existed (a
database migrated to it) takes the stream it next sees for its own.

A projector does not move its position back by itself: messages of the new stream may already have been applied
under the old position (its reader takes up a stream of the same name again after a gap), and a stream restored
from a backup under a new creation time holds the very messages applied, so only a rebuild from the log as it is
now gives the rows it holds (`hearth-replay rebuild`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import timezone

from hearth.events.cancellation import keeping_cancellation

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamState:
    """What the broker says of a stream now: its creation time (ISO 8601, UTC) and last sequence."""

    created: str | None
    last_seq: int


async def stream_state(js, stream: str) -> StreamState:
    info = await keeping_cancellation(js.stream_info(stream))
    created = info.created.astimezone(timezone.utc).isoformat() if info.created is not None else None
    return StreamState(created=created, last_seq=int(info.state.last_seq))


async def poll_streams(streams: Iterable[str], check: Callable[[str], Awaitable[None]], every_s: float, *,
                       at_once: asyncio.Event) -> None:
    """`check` each stream now, then every `every_s`, and again as soon as `at_once` is set, until cancelled."""
    while True:
        at_once.clear()
        for stream in streams:
            await check(stream)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(every_s):  # not wait_for: a stop landing as it ends would be dropped (3.11)
                await at_once.wait()


def replaced(state: StreamState, *, position: int, recorded: str | None) -> bool:
    """Whether the stream `state` describes is not the one `position` was taken in (created at `recorded`)."""
    return position > 0 and state.created is not None and recorded is not None and state.created != recorded


class StreamIdentities:
    """One projector's record of the stream each position was taken in, and of the streams found created again."""

    def __init__(self, streams: Iterable[str]) -> None:
        # The creation time of the stream each position was taken in (None: not recorded yet).
        self.recorded: dict[str, str | None] = {stream: None for stream in streams}
        # The creation time of each stream as first seen, before anything of it was read: what a fresh position
        # was taken in, recorded once it exists (a stream created again meanwhile then shows as replaced).
        self._first_seen: dict[str, str] = {}
        # Streams found deleted and created again since the position was taken in them, with their new creation time.
        self.replaced: dict[str, str] = {}

    async def check(self, stream: str, state: StreamState, position: int, *,
                    record: Callable[[str, str], Awaitable[None]]) -> None:
        """Record the stream `position` was taken in once there is one (`record(stream, created)` writes it to the
        read model), and say once (at ERROR) when `stream` is no longer that one."""
        recorded = self.recorded[stream]
        if state.created is not None:
            self._first_seen.setdefault(stream, state.created)
        if position > 0 and recorded is None and state.created is not None:
            created = self._first_seen[stream]
            await record(stream, created)
            self.recorded[stream] = recorded = created
        if replaced(state, position=position, recorded=recorded) and self.replaced.get(stream) != state.created:
            self.replaced[stream] = state.created
            log.error("projector: %s was deleted and created again (at %s; this read model's position %d was taken "
                      "in the stream created at %s): its sequences started over, so this read model no longer "
                      "follows the log; rebuild it (`hearth-replay rebuild`; a process whose read model is "
                      "temporary, restarted)", stream, state.created, position, recorded)
