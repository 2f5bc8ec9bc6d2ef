"""The steward's note of the member changes the roster holds whose event some stream's log lacked when they were made
(`unpublished.json` beside the roster, mode 0600): noted by `hearth community add`, `remove` and `rotate-key` where a
stream did not take the event (or --offline, or no broker), shown by `hearth community list`, and settled by
`hearth community publish-pending` as it finds or puts each change on each stream. A hint kept on the steward's
machine only: publish-pending reads the log itself, whatever this note says."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hearth.trust.keys import read_bounded_file, write_private_file
from hearth.trust.roster import MEMBER_NAME_PATTERN

UNPUBLISHED_FILE = "unpublished.json"
# Far above what a community changes while its broker is away; a bound on what is read back all the same.
max_unpublished_changes = 10_000
max_unpublished_file_bytes = 4 * 1024 * 1024

MemberChangeKind = Literal["addition", "key rotation", "removal"]


class UnpublishedChange(BaseModel):
    """One change of `member` and the streams whose log lacked its event."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    member: str = Field(pattern=MEMBER_NAME_PATTERN)
    change: MemberChangeKind
    streams: list[str] = Field(min_length=1, max_length=8)


class UnpublishedChanges(BaseModel):
    """What the note holds."""

    model_config = ConfigDict(extra="forbid")

    changes: list[UnpublishedChange] = Field(default_factory=list, max_length=max_unpublished_changes)


def unpublished_path(community_dir: Path) -> Path:
    return community_dir / UNPUBLISHED_FILE


def read_unpublished(community_dir: Path) -> list[UnpublishedChange]:
    """The changes noted ([] when there is no note); ValueError (naming the file) or OSError when it does not read."""
    path = unpublished_path(community_dir)
    try:
        data = read_bounded_file(path, max_unpublished_file_bytes)
    except ValueError as error:
        raise ValueError(f"{path} holds {error}") from None
    if data is None:
        return []
    try:
        return UnpublishedChanges.model_validate_json(data).changes
    except ValidationError as error:
        raise ValueError(f"{path} is not a note of unpublished changes: {error.errors()[0]['msg']}") from None


def _write(community_dir: Path, changes: list[UnpublishedChange]) -> None:
    if not changes:
        with contextlib.suppress(FileNotFoundError):
            unpublished_path(community_dir).unlink()
        return
    write_private_file(unpublished_path(community_dir), UnpublishedChanges(changes=changes).model_dump_json(
        indent=1).encode())


def note_unpublished(community_dir: Path, member: str, change: MemberChangeKind, streams: Iterable[str]) -> None:
    """Note that `streams`' logs lack `member`'s `change` (with those a note of it already named); a note that does
    not read is replaced. OSError when it cannot be written."""
    streams = list(streams)
    if not streams:
        return
    try:
        changes = read_unpublished(community_dir)
    except ValueError:
        changes = []
    earlier = next((kept for kept in changes if (kept.member, kept.change) == (member, change)), None)
    if earlier is not None:
        streams = sorted({*earlier.streams, *streams})
    noted = UnpublishedChange(member=member, change=change, streams=streams)
    _write(community_dir, [noted if kept is earlier else kept for kept in changes] + ([] if earlier else [noted]))


def settle_unpublished(community_dir: Path, members: Collection[str], lacking: Mapping[str, Collection[str]]) -> None:
    """After the log was read and given what it lacked of `members`: each of their notes keeps only the streams
    `lacking[member]` names (those that still lack some change of it); the rest of the note stays as it was. OSError
    when it cannot be written."""
    try:
        changes = read_unpublished(community_dir)
    except ValueError:
        changes = []
    kept = []
    for noted in changes:
        if noted.member in members:
            streams = [stream for stream in noted.streams if stream in lacking.get(noted.member, ())]
            if not streams:
                continue
            noted = noted.model_copy(update={"streams": streams})
        kept.append(noted)
    if kept != changes or not kept:
        _write(community_dir, kept)
