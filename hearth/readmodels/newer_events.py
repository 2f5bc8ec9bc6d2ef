"""Tells, as a read model is upgraded, of the events an older projector of it kept as a newer hearth's (rejected
`newer_hearth`) that this hearth reads: their positions are behind the projection, so only a rebuild from the log
applies them."""

from __future__ import annotations

import logging
from pathlib import Path

from sqlalchemy import Connection

from hearth.events.models import READABLE_VERSIONS
from hearth.events.newer_hearth import readable_now
from hearth.readmodels.rejections import NEWER_HEARTH

log = logging.getLogger(__name__)


def events_now_readable(connection: Connection) -> dict[str, int]:
    """Per type (and version) this hearth reads, how many of the events kept as a newer hearth's are of it (kept
    ones: rejected_events holds a sample of each minute's)."""
    found = connection.exec_driver_sql(
        "SELECT type, COUNT(*) FROM rejected_events WHERE reason = ? GROUP BY type ORDER BY type", (NEWER_HEARTH,))
    return {label: count for label, count in found if readable_now(label, READABLE_VERSIONS)}


def tell_of_events_now_readable(connection: Connection, path: str | Path) -> dict[str, int]:
    """Warn, in one line naming them and the way to apply them, when the read model at `path` holds events kept as a
    newer hearth's that this hearth reads; what it found."""
    found = events_now_readable(connection)
    if found:
        kinds = ", ".join(f"{label} ({count})" for label, count in found.items())
        log.warning("%s: an older hearth's projector skipped events of a newer hearth that this one reads (%s; "
                    "kept as rejected newer_hearth) and never applied them: rebuild this read model from the log to "
                    "apply them (hearth-replay rebuild --db %s --force; a rebuild holds only what the log still does, "
                    "so take a hearth db backup first)", path, kinds, path)
    return found
