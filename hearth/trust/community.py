"""A community folder on disk: `roster.json` (shared with every member) and `keys/<name>.nk` for the member keys
generated here (each mode 0600 in a folder of mode 0700, handed to its member), among them `keys/system.nk`, the
steward's own key; each written atomically (hearth/trust/keys.py, write_private_file)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from hearth.trust.keys import MemberKey
from hearth.trust.roster import (
    ROSTER_FILE,
    SYSTEM_MEMBER,
    Member,
    RemovalCut,
    RemovedMember,
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
        removal and the seed file deleted (None: there was none)."""
        updated = self.roster().without_member(name, removed_at=removed_at or datetime.now(timezone.utc), cuts=cuts)
        updated.save(self.roster_path)
        seed_file = seed_path(self.directory, name)
        try:
            seed_file.unlink()
        except FileNotFoundError:
            seed_file = None
        return updated.removed[-1], seed_file
