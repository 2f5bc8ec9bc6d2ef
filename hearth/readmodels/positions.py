"""Each projection's position per stream (its last applied sequence), read and moved inside a batch's transaction.

Moving a position is guarded by the value read at the start of the batch, so two projectors writing the
same database cannot both apply a batch: the second one fails with ConcurrentProjectionError and its
transaction rolls back.
"""

from __future__ import annotations

from sqlalchemy import Table
from sqlalchemy.orm import Session

from hearth.readmodels.batch_rows import session_cursor
from hearth.readmodels.tables import ProjectionPosition

PROJECTION_NAME = "readmodels"

POSITIONS: Table = ProjectionPosition.__table__


class ConcurrentProjectionError(RuntimeError):
    """Another writer moved this projection's position during our transaction; the batch was not applied."""


def load_positions(session: Session, projection: str = PROJECTION_NAME) -> dict[str, int]:
    """The last applied sequence per stream (streams never applied are absent)."""
    return _per_stream(session, projection, "last_seq")


def load_stream_identities(session: Session, projection: str = PROJECTION_NAME) -> dict[str, str | None]:
    """The creation time of the stream each position was taken in (None: not recorded yet)."""
    return _per_stream(session, projection, "stream_created")


def _per_stream(session: Session, projection: str, column: str) -> dict:
    cursor = session_cursor(session)
    try:
        cursor.execute(f"SELECT stream, {column} FROM {POSITIONS.name} WHERE projection = ?", (projection,))
        return dict(cursor.fetchall())
    finally:
        cursor.close()


def record_stream_identity(session: Session, projection: str, stream: str, created: str) -> None:
    """Record the creation time of the stream `stream`'s position was taken in."""
    cursor = session_cursor(session)
    try:
        cursor.execute(f"UPDATE {POSITIONS.name} SET stream_created = ? WHERE projection = ? AND stream = ?",
                       (created, projection, stream))
    finally:
        cursor.close()


def save_position(
    session: Session, projection: str, stream: str, previous_seq: int | None, last_seq: int, last_event_at: int
) -> None:
    """Move `stream`'s position from `previous_seq` (None: never applied) to `last_seq`, in the session's
    transaction; ConcurrentProjectionError if another writer moved it since it was read."""
    cursor = session_cursor(session)
    try:
        if previous_seq is None:
            # Another projector's first position, inserted meanwhile, is the same race as one moved: the key stops ours.
            cursor.execute(
                f"INSERT INTO {POSITIONS.name} (projection, stream, last_seq, last_event_at) "
                "VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (projection, stream, last_seq, last_event_at),
            )
            if cursor.rowcount != 1:
                raise ConcurrentProjectionError(
                    f"projection {projection!r} position of {stream} was taken under us (expected none)")
            return
        # Guarded by the value we read: if another projector advanced it meanwhile, nothing matches.
        cursor.execute(
            f"UPDATE {POSITIONS.name} SET last_seq = ?, last_event_at = ? "
            "WHERE projection = ? AND stream = ? AND last_seq = ?",
            (last_seq, last_event_at, projection, stream, previous_seq),
        )
        if cursor.rowcount != 1:
            raise ConcurrentProjectionError(
                f"projection {projection!r} position of {stream} moved under us (expected {previous_seq})"
            )
    finally:
        cursor.close()
