"""The new seed of a key rotation in progress, kept beside the roster (`keys/NAME.nk.pending`, mode 0600) from before
its `member.key_rotated` is published until the roster names the new key, so that a rerun after a failure (the roster
not saved, the process killed) names in the roster the key the log already names; bound to the member and to the key
it replaces, so it serves no other member and no later rotation."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hearth.trust.keys import KeyFileError, MemberKey, make_private_folder, read_private_file, write_private_file
from hearth.trust.roster import MEMBER_NAME_PATTERN, Member, MemberPublicKey, seed_path

PENDING_SUFFIX = ".pending"
MAX_PENDING_FILE_BYTES = 4096  # a name, a public key and a seed


class PendingSeed(BaseModel):
    """What the pending file holds: whose key it replaces (the member and its key then) and the new seed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    member: str = Field(pattern=MEMBER_NAME_PATTERN)
    replaces: MemberPublicKey
    seed: str = Field(max_length=256)


def pending_seed_path(community_dir: Path, name: str) -> Path:
    path = seed_path(community_dir, name)
    return path.with_name(path.name + PENDING_SUFFIX)


def keep_pending_seed(community_dir: Path, member: Member, key: MemberKey) -> Path:
    """Write `key`'s seed as the one that replaces `member`'s current key (write_private_file: atomic, 0600)."""
    path = pending_seed_path(community_dir, member.name)
    make_private_folder(path.parent)
    pending = PendingSeed(member=member.name, replaces=member.public_key, seed=key.seed.decode())
    write_private_file(path, pending.model_dump_json().encode())
    return path


def pending_seed(community_dir: Path, member: Member) -> MemberKey | None:
    """The seed kept for a rotation of `member`'s current key, if one is; a file kept for another member or for a
    key the member no longer holds (its rotation finished, or the process was killed before deleting it) is
    deleted, never used. KeyFileError for one that cannot be read, others may read, or is malformed."""
    path = pending_seed_path(community_dir, member.name)
    if not path.exists() and not path.is_symlink():
        return None
    data = read_private_file(path, "the pending rotation's seed")
    try:
        if len(data) > MAX_PENDING_FILE_BYTES:
            raise ValueError("too long")
        pending = PendingSeed.model_validate(json.loads(data))
        key = MemberKey.from_seed(pending.seed.encode())
    except (ValueError, ValidationError, KeyFileError) as error:
        raise KeyFileError(f"{path} is not a pending rotation's seed ({type(error).__name__}); delete it if no "
                           "rotation event names its key, else run rotate-key with --public-key") from None
    if (pending.member, pending.replaces) != (member.name, member.public_key):
        discard_pending_seed(community_dir, member.name)
        return None
    return key


def discard_pending_seed(community_dir: Path, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        pending_seed_path(community_dir, name).unlink()
