"""Keeps one event that no handler can apply from stopping a projection: a batch that fails on what a message holds is
applied again message by message, each in a transaction of its own, and the one that still fails alone is recorded
in rejected_events as `unapplicable` (its position moves past it) instead of being retried forever.

Why: a live projector retries a failed batch from the stored positions, so an event that passes decoding but makes a
handler or the flush of its rows raise would be retried for good, and every read model (routing among them) would stay
behind it. Decoding already refuses what no read model can hold (hearth/events/consume.py); this is the net under it.
The rule is deterministic, as the rows must be: a message fails alone on the rows the messages before it left, the same
rows in a live projector, a rebuild and `hearth-replay verify`, whatever their batches. A failure of the database or of
the machine (locked, full, out of memory, another projector moving the position, a damaged file) is no message's: it
propagates, and the caller retries as before (or, for a damaged file, stops: hearth/readmodels/runner.py).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Sequence
from typing import TypeVar

from sqlalchemy.exc import InterfaceError, OperationalError

from hearth.events.signing import RejectionReason
from hearth.readmodels.db import damaged_file
from hearth.readmodels.positions import ConcurrentProjectionError

log = logging.getLogger(__name__)

UNAPPLICABLE: RejectionReason = "unapplicable"

# Failures of the database, the machine or a concurrent writer, never of a message: not a reason to reject one.
NOT_THE_MESSAGES_FAULT: tuple[type[BaseException], ...] = (
    OperationalError, InterfaceError, sqlite3.OperationalError, sqlite3.InterfaceError, OSError, MemoryError,
    ConcurrentProjectionError)


def not_the_messages_fault(error: BaseException) -> bool:
    """Whether `error` is the database's, the machine's or a concurrent writer's: one of NOT_THE_MESSAGES_FAULT, or
    SQLite finding the file damaged (a DatabaseError like a message's, told by its code), which rejecting messages
    would only hide while each event went unapplied."""
    return isinstance(error, NOT_THE_MESSAGES_FAULT) or damaged_file(None, error) is not None

M = TypeVar("M")
R = TypeVar("R")

# `transaction(messages, reject_as)`: applies `messages` in one committed transaction (with `reject_as`, records every
# one not applied before as rejected for that reason instead of handling it) and returns what the caller keeps of it.
Transaction = Callable[[Sequence[M], RejectionReason | None], list[R]]


def apply_rejecting_the_unapplicable(transaction: Transaction, batch: Sequence[M], *, projection: str) -> list[R]:
    """`transaction(batch, None)`; where it fails on a message's content, the batch's messages one by one, each that
    fails alone applied again as rejected (`UNAPPLICABLE`). The results of every committed transaction, in order."""
    try:
        return transaction(batch, None)
    except Exception as error:
        if not_the_messages_fault(error):
            raise
        if len(batch) > 1:
            log.warning("%s: a batch of %d messages failed (%s); applying them one by one", projection, len(batch),
                        type(error).__name__)
    results: list[R] = []
    for message in batch:
        try:
            results.extend(transaction((message,), None))
        except Exception as error:
            if not_the_messages_fault(error):
                raise
            # The type and first line only: a message's content is never logged.
            first_line = str(error).partition("\n")[0][:200]
            log.warning("%s: %s #%s cannot be applied (%s: %s); recorded as rejected (%s)", projection,
                        getattr(message, "stream", "?"), getattr(message, "seq", "?"), type(error).__name__,
                        first_line, UNAPPLICABLE)
            results.extend(transaction((message,), UNAPPLICABLE))
    return results
