"""Records the ids of the events a read model applied before it kept ids (one upgraded to migration 0017, when
applied_events began), read back from the stream and not applied again, so a copy of one stored later is still
rejected `duplicate` (hearth/readmodels/applied_events.py).

When: a projector's start, for each stream it has a position in (> 0) and not one id of (the upgrade leaves the
table empty; a read model that kept ids since has some, unless all aged out, when this finds nothing to add either).

What is read: only what a copy can still be counted for. A copy stored from now on of an event that occurred more
than the ids are kept (`history_kept_s`) before it is rejected `too_old` without an id, so the read starts at the
messages stored that long ago (and `applied_ids_margin_s` more, for an emitter's clock ahead of the broker's) and
ends at the position; without a retention policy (ids kept for ever) it is all the stream still holds up to there.
Each message is read once, the ids written a few thousand per short transaction, with a progress line at INFO.
On a community mesh only an event the verifier passes is recorded: a forged event rejected then must not make the real
one, stored later, a duplicate. It is judged as a projection judges it now, after the removals and steward rotations
the stream stored before it (hearth/events/logged_keys.py): those are read first, from the stream's first message, as
the part read for ids may start after a rotation whose new steward key signed events in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import datetime, timedelta, timezone

from sqlalchemy.orm import Session, sessionmaker

from hearth.events.consume import StoredEvent, read_stream
from hearth.events.logged_keys import LoggedKeys
from hearth.events.models import MemberChange
from hearth.events.signing import EventVerifier
from hearth.events.streams import MEMBER_REMOVAL_SUBJECTS
from hearth.readmodels.applied_events import keeps_id, record_applied
from hearth.readmodels.batch_rows import APPLIED_EVENTS, BatchRows, session_cursor
from hearth.readmodels.projection import ReadModelProjection
from hearth.readmodels.retention import applied_ids_margin_s, history_kept_s

log = logging.getLogger(__name__)

# Ids written per transaction (short, so a reader of the database waits little).
ids_per_transaction = 2_000
# A progress line at most this often.
progress_every_s = 5.0


async def record_ids_applied_before(js, session_factory: sessionmaker[Session], projection: ReadModelProjection,
                                    positions: dict[str, int]) -> None:
    """For each stream and its position (its sequences those of the stream as it is now), what
    `record_stream_ids_applied_before` does; a failure leaves copies of those events to count once more, said."""
    for stream, position in positions.items():
        try:
            await record_stream_ids_applied_before(js, session_factory, projection, stream, position)
        except Exception as error:  # the projector starts all the same
            log.error("projector %s: the ids of %s's events applied before they were kept were not recorded (%s: %s):"
                      " a copy of one stored from now on counts once more", projection.name, stream,
                      type(error).__name__, error)


async def record_stream_ids_applied_before(js, session_factory: sessionmaker[Session],
                                           projection: ReadModelProjection, stream: str, position: int) -> int:
    """Record the ids of `stream`'s retained events up to `position` when the read model keeps none of that stream
    (see the module); the number of events whose ids were recorded (0 when it keeps some already, or has applied
    nothing)."""
    if position <= 0 or await asyncio.to_thread(_keeps_ids_of, session_factory, stream):
        return 0
    kept_s = history_kept_s(projection.retention, stream)
    from_time = None if kept_s is None else datetime.now(timezone.utc) - timedelta(
        seconds=kept_s + applied_ids_margin_s)
    log.info("projector %s: no applied event ids kept of %s (a read model from before they were kept): recording "
             "those of its events up to #%d stored %s, without applying them again", projection.name, stream, position,
             "at any time" if from_time is None else f"since {from_time.isoformat(timespec='seconds')}")
    read = recorded = 0
    pending: list[StoredEvent] = []
    said_at = time.monotonic()
    logged = None if projection.verifier is None else LoggedRemovals(
        projection.verifier, await _removals(js, stream, position))
    async with contextlib.aclosing(read_stream(js, stream, to_seq=position, from_time=from_time)) as messages:
        async for message in messages:
            read += 1
            if (isinstance(message, StoredEvent) and keeps_id(message)
                    and (logged is None or logged.passes(message))):
                pending.append(message)
            if len(pending) >= ids_per_transaction:
                recorded += await asyncio.to_thread(_record, session_factory, pending)
                pending = []
            if time.monotonic() - said_at >= progress_every_s:
                said_at = time.monotonic()
                log.info("projector %s: %s at #%d of #%d: %d ids of applied events recorded", projection.name, stream,
                         message.seq, position, recorded)
    if pending:
        recorded += await asyncio.to_thread(_record, session_factory, pending)
    log.info("projector %s: recorded the ids of %d applied events of %s (%d messages read)", projection.name,
             recorded, stream, read)
    return recorded


def _keeps_ids_of(session_factory: sessionmaker[Session], stream: str) -> bool:
    with session_factory() as session:
        cursor = session_cursor(session)
        try:
            cursor.execute(f"SELECT 1 FROM {APPLIED_EVENTS.name} WHERE stream = ? LIMIT 1", (stream,))
            return cursor.fetchone() is not None
        finally:
            cursor.close()


async def _removals(js, stream: str, position: int) -> list[StoredEvent]:
    """`stream`'s removals and key rotations up to `position`, from its first message (few: one a removal)."""
    removal_subject = MEMBER_REMOVAL_SUBJECTS.get(stream)
    if removal_subject is None:
        return []
    async with contextlib.aclosing(read_stream(js, stream, to_seq=position, subject_filter=removal_subject)) as items:
        return [item async for item in items if isinstance(item, StoredEvent) and isinstance(item.event, MemberChange)]


class LoggedRemovals:
    """The verdicts of a projection on a stream's events read in order, told of the removals and steward rotations
    stored before each (read ahead, `removals`, and taken in as the read passes their positions)."""

    def __init__(self, verifier: EventVerifier, removals: list[StoredEvent]) -> None:
        self.verifier = verifier
        self._ahead = iter(removals)
        self._next = next(self._ahead, None)
        self._logged = LoggedKeys()

    def passes(self, message: StoredEvent) -> bool:
        """Whether the projection may have applied `message`."""
        while self._next is not None and self._next.seq < message.seq:
            if self._logged.rejection(self.verifier, self._next) is None:
                self._logged.record(self._next.event)  # type: ignore[arg-type]
            self._next = next(self._ahead, None)
        return self._logged.rejection(self.verifier, message) is None


def _record(session_factory: sessionmaker[Session], messages: list[StoredEvent]) -> int:
    with session_factory() as session, session.begin():
        rows = BatchRows(session)
        try:
            for message in messages:
                record_applied(message, rows)
            rows.flush()
        finally:
            rows.close()
    return len(messages)
