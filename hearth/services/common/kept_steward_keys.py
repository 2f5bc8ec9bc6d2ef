"""The steward's key rotations a process learned from the event streams, kept in a file in its state folder: read at
its next start before the streams, so that once a rotation has aged out of them (shards keep 7 days, pipelines 30) a
shard host or orchestrator still counts the new steward key as the steward's, and the retired one as no longer.

The file holds each rotation as the stream stored it (its signed body, stream, position and storage time), and is
trusted only as far as the log itself would be: each rotation is judged again, in stream order, by the verifier a
projection uses (hearth/events/logged_keys.py), so a key counts only where a chain of rotations, each signed by the
key it retires, leads back to the roster's steward key. A roster that names a later steward key wins (calls follow
the chain from the roster's key: steward_keys.steward_key_for_calls). A file that does not read or does not chain
is left out with one WARNING line, never fatal; it is rewritten (tmp + rename, 0600) whenever a new rotation is
learned."""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hearth.events.consume import StoredEvent
from hearth.events.logged_keys import LoggedKeys
from hearth.events.models import MemberKeyRotated, decode_event
from hearth.events.signing import EventVerifier
from hearth.events.steward_keys import max_chain_length
from hearth.events.streams import MEMBER_REMOVAL_SUBJECTS
from hearth.trust.keys import write_private_file
from hearth.trust.roster import SYSTEM_MEMBER

log = logging.getLogger(__name__)

STEWARD_KEYS_FILE = "steward-keys.json"
# Bounds on what is read back: one chain per stream, each no longer than a chain is ever followed.
max_kept_rotations = max_chain_length * len(MEMBER_REMOVAL_SUBJECTS)
max_rotation_body_bytes = 8192
max_file_bytes = max_kept_rotations * 2 * max_rotation_body_bytes


class KeptRotation(BaseModel):
    """One verified rotation of the steward's key as its stream stored it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stream: str = Field(min_length=1, max_length=64)
    seq: int = Field(ge=1)
    subject: str = Field(min_length=1, max_length=256)
    stored_at: datetime
    body: str = Field(min_length=1, max_length=2 * max_rotation_body_bytes)  # base64 of the body as stored

    @classmethod
    def of(cls, message: StoredEvent) -> "KeptRotation":
        return cls(stream=message.stream, seq=message.seq, subject=message.subject, stored_at=message.time,
                   body=base64.b64encode(message.data).decode("ascii"))

    def stored_event(self) -> StoredEvent:
        """The rotation as a reader of its stream would get it; ValueError when its body is not a rotation."""
        try:
            data = base64.b64decode(self.body, validate=True)
        except binascii.Error as error:
            raise ValueError(f"body is not base64: {error}") from None
        event = decode_event(data)
        if not isinstance(event, MemberKeyRotated) or event.member != SYSTEM_MEMBER:
            raise ValueError("body is not a rotation of the steward's key")
        return StoredEvent(stream=self.stream, seq=self.seq, subject=self.subject, time=self.stored_at, headers={},
                           event=event, data=data)


class KeptStewardKeys(BaseModel):
    """The file's content."""

    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    rotations: list[KeptRotation] = Field(default_factory=list, max_length=max_kept_rotations)


def write_kept_rotations(path: Path, rotations: Iterable[KeptRotation]) -> None:
    """Write `rotations` to `path` atomically, readable by this user only (OSError when it cannot be written)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    content = KeptStewardKeys(rotations=sorted(rotations, key=lambda kept: (kept.stream, kept.seq)))
    write_private_file(path, content.model_dump_json(indent=1).encode())


def read_kept_rotations(path: Path) -> list[KeptRotation]:
    """The rotations kept in `path` ([] when there is none); ValueError or OSError when it does not read."""
    try:
        with path.open("rb") as file:
            data = file.read(max_file_bytes + 1)
    except FileNotFoundError:
        return []
    if len(data) > max_file_bytes:
        raise ValueError(f"more than {max_file_bytes} bytes")
    try:
        return KeptStewardKeys.model_validate_json(data).rotations
    except ValidationError as error:
        raise ValueError(f"{error.error_count()} errors, the first: {error.errors()[0]['msg']}") from None


def trusted_rotations(verifier: EventVerifier, rotations: Iterable[KeptRotation]) -> tuple[LoggedKeys,
                                                                                            list[KeptRotation]]:
    """The steward keys `rotations` name where they chain back to the roster's steward key, judged in stream order as
    a projection judges its log, with the rotations that did (the rest, forged, stale, or cut off by a roster that
    names a later key, teach nothing)."""
    logged, kept = LoggedKeys(), []
    for rotation in sorted(rotations, key=lambda kept: (kept.stream, kept.seq)):
        if rotation.stream not in MEMBER_REMOVAL_SUBJECTS:
            continue
        try:
            message = rotation.stored_event()
        except ValueError:
            continue
        if logged.rejection(verifier, message) is not None:
            continue
        named_before = len(logged.steward_keys)
        logged.record(message.event)
        if len(logged.steward_keys) > named_before:
            kept.append(rotation)
    return logged, kept


def load_kept_steward_keys(path: Path, verifier: EventVerifier) -> tuple[LoggedKeys, list[KeptRotation]]:
    """What `path` teaches (trusted_rotations), never failing: a file that does not read, or rotations that do not
    chain back to the roster's steward key, are said in one WARNING line and left out (quietly where the roster
    already names a key the file's rotations named: the roster caught up)."""
    try:
        rotations = read_kept_rotations(path)
    except (ValueError, OSError) as error:
        log.warning("steward keys kept in %s do not read (%s): left out; the event streams and the roster say which "
                    "steward key counts", path, error)
        return LoggedKeys(), []
    logged, kept = trusted_rotations(verifier, rotations)
    left_out = len(rotations) - len(kept)
    if left_out:
        steward = verifier.current_roster().by_name(SYSTEM_MEMBER)
        roster_steward_key = steward.public_key if steward is not None else None
        caught_up = roster_steward_key is not None and any(
            rotation.stored_event().event.new_public_key == roster_steward_key for rotation in rotations
            if _is_rotation(rotation))
        (log.info if caught_up else log.warning)(
            "steward keys kept in %s: %d of %d rotations do not chain back to the roster's steward key: left out",
            path, left_out, len(rotations))
    return logged, kept


def _is_rotation(rotation: KeptRotation) -> bool:
    try:
        rotation.stored_event()
    except ValueError:
        return False
    return True
