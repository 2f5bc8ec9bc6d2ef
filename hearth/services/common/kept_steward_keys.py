"""The verified removals, key rotations and additions a process learned from the event streams, kept in a file in its
state folder: read at its next start before the streams, so that once one has aged out of them (shards keep 7 days,
pipelines 30) a shard host or orchestrator still refuses every key they retired, whatever its roster copy says, still
counts the steward's rotated key as the steward's, and a member the log added as a member.

The file holds each removal or rotation as the stream stored it (its signed body, stream, position and storage time),
and is trusted only as far as the log itself would be: each is judged again, in stream order, by the verifier a
projection uses (hearth/events/logged_keys.py), so it counts only where it was signed by a steward key of the chain of
rotations, each signed by the key it retires, that leads back to the roster's steward key. A roster that names a later
steward key wins (calls follow the chain from the roster's key: steward_keys.steward_key_for_calls). A file that does
not read, or entries that do not verify, are left out with one WARNING line, never fatal; it is rewritten (tmp +
rename, 0600) whenever a new removal is learned. Version 1 of the file (the steward's rotations alone) still reads."""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from hearth.events.consume import StoredEvent
from hearth.events.logged_keys import LoggedKeys
from hearth.events.models import MemberChange, MemberKeyRotated, MemberRemoved, decode_event
from hearth.events.signing import EventVerifier
from hearth.events.steward_keys import max_chain_length
from hearth.events.streams import MEMBER_REMOVAL_SUBJECTS
from hearth.trust.keys import read_bounded_file, write_private_file
from hearth.trust.roster import SYSTEM_MEMBER

log = logging.getLogger(__name__)

STEWARD_KEYS_FILE = "steward-keys.json"
# Bounds on what is kept and read back: a community removes few members (each removal is one entry per stream), so
# these are far above what one keeps; past them the oldest removals go first, the steward's rotations last.
max_kept_removals = 10_000
max_removal_body_bytes = 8192
max_file_bytes = 16 * 1024 * 1024  # some 800 bytes an entry: twice what max_kept_removals take
# Version 1 kept one chain of the steward's rotations per stream.
max_kept_rotations_v1 = max_chain_length * len(MEMBER_REMOVAL_SUBJECTS)


class KeptRemoval(BaseModel):
    """One verified removal or key rotation as its stream stored it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stream: str = Field(min_length=1, max_length=64)
    seq: int = Field(ge=1)
    subject: str = Field(min_length=1, max_length=256)
    stored_at: datetime
    body: str = Field(min_length=1, max_length=2 * max_removal_body_bytes)  # base64 of the body as stored

    @classmethod
    def of(cls, message: StoredEvent) -> "KeptRemoval":
        return cls(stream=message.stream, seq=message.seq, subject=message.subject, stored_at=message.time,
                   body=base64.b64encode(message.data).decode("ascii"))

    def stored_event(self) -> StoredEvent:
        """The removal as a reader of its stream would get it; ValueError when its body is not a removal."""
        try:
            data = base64.b64decode(self.body, validate=True)
        except binascii.Error as error:
            raise ValueError(f"body is not base64: {error}") from None
        event = decode_event(data)
        if not isinstance(event, MemberChange):
            raise ValueError("body is not a removal, key rotation or addition")
        return StoredEvent(stream=self.stream, seq=self.seq, subject=self.subject, time=self.stored_at, headers={},
                           event=event, data=data)

    def is_stewards_rotation(self) -> bool:
        """Whether it rotates the steward's key (what later entries are verified by: dropped last)."""
        try:
            event = self.stored_event().event
        except ValueError:
            return False
        return isinstance(event, MemberKeyRotated) and event.member == SYSTEM_MEMBER


class KeptStewardKeysV1(BaseModel):
    """The file as version 1 wrote it: the steward's rotations alone."""

    model_config = ConfigDict(extra="forbid")

    version: Literal[1]
    rotations: list[KeptRemoval] = Field(default_factory=list, max_length=max_kept_rotations_v1)


class KeptRetiredKeys(BaseModel):
    """The file's content: every verified removal and rotation, the steward's included."""

    model_config = ConfigDict(extra="forbid")

    version: Literal[2] = 2
    removals: list[KeptRemoval] = Field(default_factory=list, max_length=max_kept_removals)


_kept_file = TypeAdapter(Annotated[KeptStewardKeysV1 | KeptRetiredKeys, Field(discriminator="version")])


def in_stream_order(removals: Iterable[KeptRemoval]) -> list[KeptRemoval]:
    return sorted(removals, key=lambda kept: (kept.stream, kept.seq))


def within_bounds(removals: Iterable[KeptRemoval]) -> list[KeptRemoval]:
    """`removals` in stream order, the oldest removals left out (the steward's rotations last) while there are more
    than max_kept_removals or they would take more than max_file_bytes."""
    kept = in_stream_order(removals)
    sizes = {id(removal): len(removal.model_dump_json(indent=1)) + 64 for removal in kept}  # + the list's indent
    size, count = sum(sizes.values()) + 64, len(kept)
    if count <= max_kept_removals and size <= max_file_bytes:
        return kept
    dropped: set[int] = set()
    for removal in sorted(kept, key=lambda kept: (kept.is_stewards_rotation(), kept.stored_at)):
        if count <= max_kept_removals and size <= max_file_bytes:
            break
        dropped.add(id(removal))
        size, count = size - sizes[id(removal)], count - 1
    log.warning("retired keys kept: %d of %d oldest removals left out of the file (at most %d, %d bytes); a roster "
                "copy must name them", len(dropped), len(kept), max_kept_removals, max_file_bytes)
    return [removal for removal in kept if id(removal) not in dropped]


def write_kept_removals(path: Path, removals: Iterable[KeptRemoval]) -> list[KeptRemoval]:
    """Write `removals` (within_bounds) to `path` atomically, readable by this user only, and return what was written
    (OSError when it cannot be written)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    content = KeptRetiredKeys(removals=within_bounds(removals))
    write_private_file(path, content.model_dump_json(indent=1).encode())
    return content.removals


def read_kept_removals(path: Path) -> list[KeptRemoval]:
    """The removals kept in `path` ([] when there is none; version 1's rotations too); ValueError or OSError when it
    does not read."""
    data = read_bounded_file(path, max_file_bytes)
    if data is None:
        return []
    try:
        content = _kept_file.validate_json(data)
    except ValidationError as error:
        raise ValueError(f"{error.error_count()} errors, the first: {error.errors()[0]['msg']}") from None
    return content.rotations if isinstance(content, KeptStewardKeysV1) else content.removals


def trusted_removals(verifier: EventVerifier, removals: Iterable[KeptRemoval]) -> tuple[LoggedKeys,
                                                                                         list[KeptRemoval]]:
    """The keys `removals` retired and the steward keys they named, each judged in stream order as a projection
    judges its log (signed by a steward key the chain from the roster's reaches), with the removals that counted
    (the rest, forged, stale, repeated, or cut off by a roster that names a later steward key, teach nothing)."""
    logged, kept = LoggedKeys(), []
    for removal in in_stream_order(removals):
        if removal.stream not in MEMBER_REMOVAL_SUBJECTS:
            continue
        try:
            message = removal.stored_event()
        except ValueError:
            continue
        if logged.rejection(verifier, message) is not None:
            continue
        if not counts_on_its_stream(logged, message.event):
            continue  # only the first removal (or addition) of a key on a stream counts
        logged.record(message.event)
        kept.append(removal)
    return logged, kept


def counts_on_its_stream(logged: LoggedKeys, event: MemberChange) -> bool:
    """Whether `event`, verified, would count where `logged` stands: the first removal of its key on its stream, or an
    addition of a key and name that stream has not known yet."""
    if isinstance(event, MemberRemoved):
        return not logged.removal_logged(event.stream, event.public_key)
    return logged.would_add(event) is not None


def load_kept_removals(path: Path, verifier: EventVerifier) -> tuple[LoggedKeys, list[KeptRemoval]]:
    """What `path` teaches (trusted_removals), never failing: a file that does not read, or entries that do not
    verify, are said in one WARNING line and left out (quietly where the roster already retired every key they
    would: the roster caught up)."""
    try:
        removals = read_kept_removals(path)
    except (ValueError, OSError) as error:
        log.warning("retired keys kept in %s do not read (%s): left out; the event streams and the roster say which "
                    "keys count", path, error)
        return LoggedKeys(), []
    logged, kept = trusted_removals(verifier, removals)
    counted = {id(removal) for removal in kept}
    left_out = [removal for removal in removals if id(removal) not in counted]
    if left_out:
        former_keys = verifier.current_roster().former_keys()
        caught_up = all(_retired_key(removal) in former_keys for removal in left_out)
        (log.info if caught_up else log.warning)(
            "retired keys kept in %s: %d of %d removals do not verify by the roster's steward key and the chain of "
            "its rotations: left out", path, len(left_out), len(removals))
    return logged, kept


def _retired_key(removal: KeptRemoval) -> str | None:
    try:
        return removal.stored_event().event.public_key
    except ValueError:
        return None
