"""A community folder on disk: `roster.json` (shared with every member) and `keys/<name>.nk` for the member keys
generated here (each mode 0600 in a folder of mode 0700, handed to its member), among them `keys/system.nk`, the
steward's own key, `keys/<name>.nk.pending` while a rotation of that member's key is under way
(hearth/trust/pending_rotation.py), and `unpublished.json` while some stream's log lacks a member change
(hearth/trust/unpublished_changes.py); each written atomically (hearth/trust/keys.py, write_private_file)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from hearth.trust.keys import MemberKey, make_private_folder
from hearth.trust.pending_rotation import discard_pending_seed
from hearth.trust.roster import (
    ROSTER_FILE,
    SYSTEM_MEMBER,
    Member,
    RemovalCut,
    RemovedMember,
    RetiredKey,
    Role,
    Roster,
    RosterError,
    TrustLevel,
    new_member,
    new_roster,
    seed_path,
)


@dataclass(frozen=True)
class AddedMember:
    member: Member
    seed_file: Path | None  # None when the member brought its own public key


@dataclass(frozen=True)
class RotatedKey:
    member: Member  # holding its new key
    retired: RetiredKey
    seed_file: Path | None  # the new seed; None when the member brought its own new public key
    old_seed_deleted: Path | None  # the retired key's seed that was here, now deleted; None: there was none


@dataclass(frozen=True)
class Community:
    directory: Path

    @property
    def roster_path(self) -> Path:
        return self.directory / ROSTER_FILE

    @property
    def system_key_path(self) -> Path:
        return seed_path(self.directory, SYSTEM_MEMBER)

    @classmethod
    def init(cls, directory: Path, name: str) -> "Community":
        """A new community whose one member is the steward's system key; refuses to overwrite one. The roster is
        written last, so a refusal (a key left in keys/ from before) leaves no roster without its steward behind."""
        community = cls(directory)
        if community.roster_path.exists():
            raise RosterError(f"{community.roster_path} exists: {directory} already holds a community")
        system_key = MemberKey.generate()
        roster = new_roster(name).with_member(new_member(SYSTEM_MEMBER, "system", system_key.public_key))
        make_private_folder(directory)  # it will hold the steward's key, API keys' digests, TLS keys
        system_key.save(community.system_key_path)  # never replaces a key
        roster.save(community.roster_path)
        return community

    def roster(self) -> Roster:
        return Roster.load(self.roster_path)

    def system_key(self) -> MemberKey:
        return MemberKey.load(self.system_key_path)

    def add(self, name: str, role: Role, *, trust: TrustLevel | None = None,
            public_key: str | None = None) -> AddedMember:
        """Add a member; without `public_key` a key pair is generated and its seed written to keys/<name>.nk."""
        roster = self.roster()
        generated = MemberKey.generate() if public_key is None else None
        member = new_member(name, role, public_key or generated.public_key, trust)
        updated = roster.with_member(member)  # refuses a taken name or key before any file is written
        seed_file = None
        if generated is not None:
            seed_file = seed_path(self.directory, name)
            generated.save(seed_file)
        try:
            updated.save(self.roster_path)
        except OSError:
            if seed_file is not None:  # a key no roster names would only block adding the member again
                seed_file.unlink(missing_ok=True)
            raise
        return AddedMember(member, seed_file)

    def check_removable(self, name: str) -> None:
        """RosterError, as `remove` would raise it, without changing anything."""
        self.roster().without_member(name, removed_at=datetime.now(timezone.utc))

    def remove(self, name: str, cuts: Sequence[RemovalCut] = (),
               removed_at: datetime | None = None) -> tuple[RemovedMember, Path | None]:
        """Move `name` to the roster's removed members, removed at `removed_at` (default now), with the positions of
        the removal events published for it (`cuts`), and delete its seed file if one was left here; returns the
        removal and the seed file deleted (None: there was none), and any seed kept for a rotation of its key."""
        updated = self.roster().without_member(name, removed_at=removed_at or datetime.now(timezone.utc), cuts=cuts)
        updated.save(self.roster_path)
        discard_pending_seed(self.directory, name)
        seed_file = seed_path(self.directory, name)
        try:
            seed_file.unlink()
        except FileNotFoundError:
            seed_file = None
        return updated.removed[-1], seed_file

    def rotate_key(self, name: str, new_key: MemberKey | str, cuts: Sequence[RemovalCut] = (),
                   retired_at: datetime | None = None) -> RotatedKey:
        """Give member `name` a new key (a generated MemberKey, its seed written to keys/<name>.nk, or the public key
        the member made itself), its old key retired at `retired_at` (default now) where the rotation events went
        (`cuts`). The old key's seed, if one is here, is deleted once the roster is saved: a retired seed still opens
        every hop key sealed to it before (captured traffic) and signs nothing that counts, so keeping it only keeps
        that risk, and so is the seed kept pending for this rotation (hearth/trust/pending_rotation.py), now in
        keys/<name>.nk. A failure leaves the old seed, the pending one and the roster as they were."""
        public_key = new_key.public_key if isinstance(new_key, MemberKey) else new_key
        updated = self.roster().with_rotated_key(name, public_key, retired_at=retired_at or datetime.now(timezone.utc),
                                                 cuts=cuts)  # refuses before any file is touched
        seed_file = seed_path(self.directory, name)
        set_aside = None
        if seed_file.exists() or seed_file.is_symlink():
            # Renamed, not overwritten, until the roster names the new key: a failure puts it back.
            set_aside = seed_file.with_name(f"{seed_file.name}.retired-{datetime.now(timezone.utc):%Y%m%dT%H%M%S%fZ}")
            os.rename(seed_file, set_aside)
        written = None
        try:
            if isinstance(new_key, MemberKey):
                new_key.save(seed_file)
                written = seed_file
            updated.save(self.roster_path)
        except BaseException:
            if written is not None:
                written.unlink(missing_ok=True)
            if set_aside is not None:
                os.rename(set_aside, seed_file)
            raise
        discard_pending_seed(self.directory, name)  # the roster names the new key: a rerun has nothing to reuse
        if set_aside is not None:
            with contextlib.suppress(FileNotFoundError):
                set_aside.unlink()
        member = updated.by_name(name)
        return RotatedKey(member, member.retired_keys[-1], written,  # type: ignore[union-attr]
                          seed_file if set_aside is not None else None)
