"""Events only a newer hearth reads (a type this one does not know, or a version of its type past its own): what such
an event says of itself, so that a reader skips it in one line a while per type and version, never one per event, and
a projection keeps it as a rejected event (`newer_hearth`) that a newer projector later finds it can apply."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from hearth.events.envelope import EventEnvelope
from hearth.events.once_a_while import OnceAWhile
from hearth.protocol.bounded_values import cut_text
from hearth.protocol.bounds import max_label_chars

log = logging.getLogger(__name__)

# How a rejected_events row names the version of a known type a newer hearth wrote: "shard.advertised version 2".
VERSION_MARK = " version "
told_every_s = 3600.0
# Types are the emitters' to name: the memory of which were told is bounded.
max_remembered_kinds = 256
# What every hearth's event types look like, a family and a kind of subject-token characters ("shard.advertised"): a
# `type` of another form is no newer hearth's, only a malformed event, and is never kept under a label that could
# read as a known type's version ("shard.advertised version 1").
_type_name = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)+")


@dataclass(frozen=True)
class NewerHearthEvent:
    """A stored event of `type` (cut to a label's length) at `version`, where this hearth reads that type up to
    `readable_up_to` (None: not at all); `envelope` its common fields, None when even they do not validate."""

    type: str
    version: int
    readable_up_to: int | None
    envelope: EventEnvelope | None

    @property
    def label(self) -> str:
        """The type as a rejected_events row names it: with the version when the type is known but the version not."""
        return self.type if self.readable_up_to is None else f"{self.type}{VERSION_MARK}{self.version}"

    def reason(self) -> str:
        if self.readable_up_to is None:
            return (f"event type {self.type!r} is not one this hearth knows (a newer hearth's?): upgrade it to read "
                    f"this event")
        return (f"{self.type} version {self.version} is newer than this hearth reads (up to {self.readable_up_to}): "
                f"upgrade it to read this event")


class EventOfANewerHearth(ValueError):
    """Raised by decoding for an event only a newer hearth reads; its message is the event's `reason()`."""

    def __init__(self, newer: NewerHearthEvent) -> None:
        super().__init__(newer.reason())
        self.newer = newer


def could_be_a_type(kind: str) -> bool:
    """Whether `kind` is of the form every hearth's event types take."""
    return _type_name.fullmatch(kind) is not None


def newer_hearth_event(raw: dict[str, Any], kind: str, version: int, readable_up_to: int | None) -> EventOfANewerHearth:
    """The refusal of `raw`, of `kind` at `version`, carrying its envelope where that validates."""
    try:
        envelope: EventEnvelope | None = EventEnvelope.model_validate(raw)
    except (ValidationError, ValueError, TypeError, OverflowError):
        envelope = None
    # Cut as a label is, and readable: a JSON escape may have made it a lone surrogate, which no database row takes.
    return EventOfANewerHearth(NewerHearthEvent(cut_text(max_label_chars)(kind), version, readable_up_to, envelope))


def readable_now(label: str, readable_versions: Mapping[str, int]) -> bool:
    """Whether the event a rejected_events row names by `label` (NewerHearthEvent.label) is one this hearth reads,
    given the latest version of each type it reads."""
    kind, _, version = label.partition(VERSION_MARK)
    known = readable_versions.get(kind)
    # ASCII digits only: a label kept by an earlier hearth may carry any text ("²" is a digit int() does not read).
    return known is not None and (not version or (version.isascii() and version.isdigit() and int(version) <= known))


class NewerHearthNotices:
    """Logs a warning the first time a reader skips an event of a type and version only a newer hearth reads, and again
    only after `every_s`: a long-running reader is reminded, never told once per event."""

    def __init__(self, *, every_s: float = told_every_s, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._told = OnceAWhile(every_s, max_remembered_kinds, monotonic=monotonic)

    def skipped(self, newer: NewerHearthEvent, where: str) -> bool:
        """Say that the event at `where` (stream#seq on its subject) was skipped, unless told lately. True: logged."""
        if not self._told.due((newer.type, newer.version)):
            log.debug("skipping %s: %s", where, newer.reason())
            return False
        log.warning("skipping %s and every event like it: %s (told once every %.0f min; each counted in "
                    "hearth_events_undecodable_total)", where, newer.reason(), self._told.every_s / 60)
        return True
