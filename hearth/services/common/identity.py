"""Who this process is on the broker: its member key (the nkey seed file given with --creds) and its name
from the community roster, which is also its node id and its inbox token."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hearth.protocol.subjects import inbox_prefix
from hearth.trust.keys import KeyFileError, MemberKey
from hearth.trust.roster import KEYS_DIR, ROSTER_FILE, Member, Roster, RosterError


class IdentityError(ValueError):
    """The key file or roster cannot be used, or the key is not a member's; one line for the user."""


@dataclass(frozen=True)
class Identity:
    """A key and the name it goes by; `member` is None for the server's system user (not in the roster)."""

    name: str
    key: MemberKey
    member: Member | None = None

    @property
    def inbox_prefix(self) -> str:
        return inbox_prefix(self.name)


def default_roster_for(creds_file: Path) -> Path | None:
    """`community/roster.json` for a key in `community/keys/` (the layout `hearth community` writes)."""
    if creds_file.parent.name == KEYS_DIR and (creds_file.parent.parent / ROSTER_FILE).is_file():
        return creds_file.parent.parent / ROSTER_FILE
    return None


def load_identity(creds_file: Path, roster_file: Path | None = None) -> Identity:
    """The identity in `creds_file`, named by the roster (given, or the one beside the key); a key with no
    roster to look it up in goes by its file's name."""
    try:
        key = MemberKey.load(creds_file)
    except KeyFileError as error:
        raise IdentityError(str(error)) from None
    roster_file = roster_file or default_roster_for(creds_file)
    if roster_file is None:
        return Identity(name=creds_file.stem, key=key)
    try:
        roster = Roster.load(roster_file)
    except RosterError as error:
        raise IdentityError(str(error)) from None
    member = roster.by_key(key.public_key)
    gone = roster.removed_by_key(key.public_key)
    if gone is not None:
        raise IdentityError(f"the key in {creds_file} belonged to {gone.member.name!r}, removed from the "
                            f"community at {gone.removed_at:%Y-%m-%d %H:%M:%S} UTC; a member coming back needs a new "
                            "name and key")
    retired = roster.retired_key_of(key.public_key)
    if retired is not None:
        holder, retirement = retired
        raise IdentityError(f"the key in {creds_file} is one {holder.name!r} retired at "
                            f"{retirement.retired_at:%Y-%m-%d %H:%M:%S} UTC (`hearth community rotate-key`); use "
                            "the new seed the steward gave it")
    if member is None:
        raise IdentityError(f"the key in {creds_file} ({key.public_key[:12]}...) is not a member of the roster "
                            f"{roster_file}; ask a steward to run `hearth community add`")
    return Identity(name=member.name, key=key, member=member)
