"""The community roster: each member's name, role, trust level and public key, kept in one JSON file the
community shares, plus the folder layout `hearth community` writes (roster and generated seed files)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from hearth.trust.keys import PRIVATE_FOLDER_MODE, PUBLIC_KEY_PATTERN, check_public_key, write_private_file

Role = Literal["shard", "orchestrator", "projector", "client", "auditor", "system"]
# The roles `hearth community add` gives; `system` is the steward's own key, made once by `community init`, which
# the broker lets do anything (watch every subject, manage the streams) and the orchestrator answers.
ROLES: tuple[Role, ...] = ("shard", "orchestrator", "projector", "client", "auditor")
SYSTEM_MEMBER = "system"
# Roles whose members may call the orchestrators (`llm.chat.request`, `llm.models`): the broker lets only them publish
# there, orchestrators answer only into their inboxes, and a call signed by any other member's key is refused.
CALLER_ROLES: tuple[Role, ...] = ("client", "system")
TrustLevel = Literal["member", "trusted", "steward"]
TRUST_ORDER: dict[TrustLevel, int] = {"member": 0, "trusted": 1, "steward": 2}
# Hosts that serve shards or orchestrate see activations (from which a prompt can be recovered), so a steward
# adding one vouches for it; people who only ask questions or read the log start as plain members.
DEFAULT_TRUST: dict[Role, TrustLevel] = {"shard": "trusted", "orchestrator": "trusted", "projector": "trusted",
                                         "client": "member", "auditor": "member", "system": "steward"}
# A name becomes a NATS subject token (node ids, inbox prefixes), so no dots, wildcards or spaces.
MEMBER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$"
ROSTER_FILE = "roster.json"
# What a roster file says it is; fields added since are left out of the file while unused, so an older hearth reads it.
ROSTER_FORMAT = 1
KEYS_DIR = "keys"
SEED_SUFFIX = ".nk"
# A member's nkey public key as the roster holds it: the pattern (in its JSON schema too), then the checksum and
# prefix byte, so a mistyped key is refused where the roster is read, not where a signature later fails.
MemberPublicKey = Annotated[str, Field(pattern=PUBLIC_KEY_PATTERN), AfterValidator(check_public_key)]


class RosterError(ValueError):
    """The roster file is missing or malformed, or a change to it would break one of its rules."""


def trust_at_least(level: TrustLevel, minimum: TrustLevel) -> bool:
    return TRUST_ORDER[level] >= TRUST_ORDER[minimum]


class RemovalCut(BaseModel):
    """Where a member's removal falls in one event stream: the sequence of the signed `member.removed` the steward
    published there (hearth/events/models.py, MemberRemoved), and when the broker stored it (its clock, not the
    steward's): a stream deleted and created again numbers its messages from 1, and what it stores after that time
    still comes after the removal."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stream: str = Field(min_length=1, max_length=64)
    seq: int = Field(ge=1)
    event_id: str = Field(min_length=1, max_length=64)
    # None in a roster written before cuts held it.
    stored_at: AwareDatetime | None = None

    def passed_by(self, seq: int, stored_at: datetime, event_id: str | None = None) -> bool:
        """Whether a message of this stream stored at `seq`, at `stored_at` by the broker's clock, came after the
        removal: after it in the stream, or stored later (a stream created again since). The removal event itself
        (`event_id` at the cut's place) never does: the rotation of the steward's own key is signed by that key, and
        its storage time as a reader sees it may be a microsecond off the one kept here (read back another way)."""
        if seq == self.seq and event_id == self.event_id:
            return False
        return seq > self.seq or (self.stored_at is not None and stored_at > self.stored_at)


class RetiredKey(BaseModel):
    """A key a member held before `hearth community rotate-key` replaced it: what it signed before its retirement
    still verifies (the audit trail), nothing after. Its place in each stream is the steward's signed
    `member.key_rotated` there (`cuts`, as a removal's); without one, `retired_at`, the steward's clock."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    public_key: MemberPublicKey
    retired_at: AwareDatetime
    cuts: list[RemovalCut] = Field(default_factory=list, max_length=8)


class Member(BaseModel):
    """One member: `name` is also its node id and NATS inbox token; `public_key` its nkey (`U...`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=MEMBER_NAME_PATTERN)
    role: Role
    trust: TrustLevel
    public_key: MemberPublicKey
    added_at: datetime
    # Oldest first; absent from a roster written before key rotation (and left out of the file while empty, so a
    # roster that never rotated a key still reads in an older hearth).
    retired_keys: list[RetiredKey] = Field(default_factory=list, max_length=1000)

    @model_serializer(mode="wrap")
    def _without_empty_retired_keys(self, handler: SerializerFunctionWrapHandler) -> dict:
        dumped = handler(self)
        if not self.retired_keys:
            dumped.pop("retired_keys", None)
        return dumped

    def as_retired(self, retired: RetiredKey) -> "RemovedMember":
        """This member as the holder of its retired key: a removal of that key alone, cut where it was retired."""
        holder = self.model_copy(update={"public_key": retired.public_key, "retired_keys": []})
        return RemovedMember(member=holder, removed_at=retired.retired_at, cuts=list(retired.cuts))


class RemovedMember(BaseModel):
    """A member no longer in the community: kept so that what it signed while it belonged still verifies, and so
    that its key, perhaps leaked, can never join again. Where it left each stream is the position of its removal
    event there (`cuts`); on a stream without one (a removal made before removal events, or that could not publish
    one) the broker's storage time of an event, not its claimed time, is set against `removed_at`, the steward's
    clock."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    member: Member
    removed_at: AwareDatetime
    cuts: list[RemovalCut] = Field(default_factory=list)

    def cut_in(self, stream: str) -> RemovalCut | None:
        return next((cut for cut in self.cuts if cut.stream == stream), None)

    def stored_after_removal(self, stored_at: datetime, stream: str | None = None, seq: int | None = None,
                             event_id: str | None = None) -> bool:
        """Whether an event (`event_id`) of this member's key that `stream` stored at `seq` (at `stored_at`, by the
        broker's clock) came after its removal: by the removal event's position where the stream has one, else by
        `removed_at`."""
        cut = self.cut_in(stream) if stream is not None and seq is not None else None
        if cut is not None:
            return cut.passed_by(seq, stored_at, event_id)  # type: ignore[arg-type]
        return stored_at >= self.removed_at


class Roster(BaseModel):
    """The community's members; names and public keys are unique, and no member holds a removed member's key."""

    model_config = ConfigDict(extra="forbid")

    format: Literal[1] = ROSTER_FORMAT
    community: str = Field(min_length=1, max_length=100)
    created_at: datetime
    members: list[Member] = Field(default_factory=list)
    # Absent from a roster written before removals, and left out of the file while empty (as a member's
    # `retired_keys`), so a community that never removed a member keeps its roster readable by an older hearth.
    removed: list[RemovedMember] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _without_empty_removed(self, handler: SerializerFunctionWrapHandler) -> dict:
        dumped = handler(self)
        if not self.removed:
            dumped.pop("removed", None)
        return dumped

    @model_validator(mode="after")
    def _unique(self) -> "Roster":
        for attribute in ("name", "public_key"):
            values = [getattr(member, attribute) for member in self.members]
            duplicated = sorted({value for value in values if values.count(value) > 1})
            if duplicated:
                raise ValueError(f"members share a {attribute}: {', '.join(duplicated)}")
        revoked = set(self.former_keys())
        reused = sorted(member.name for member in self.members if member.public_key in revoked)
        if reused:
            raise ValueError(f"members hold the key of a removed member or a retired key: {', '.join(reused)}")
        every_key = [member.public_key for member in self.members] + [
            retired.public_key for holder in self._holders() for retired in holder.retired_keys] + [
            gone.member.public_key for gone in self.removed]
        if len(every_key) != len(set(every_key)):
            raise ValueError("a retired key is held again (by its member, another one or a removed member)")
        gone_names = {gone.member.name for gone in self.removed}
        renamed = sorted(member.name for member in self.members if member.name in gone_names)
        if renamed:
            raise ValueError(f"members bear the name of a removed member: {', '.join(renamed)}")
        return self

    def by_name(self, name: str) -> Member | None:
        """The current member named `name` (removed ones are not members)."""
        return next((member for member in self.members if member.name == name), None)

    def by_key(self, public_key: str) -> Member | None:
        """The current member holding `public_key` (removed ones are not members)."""
        return next((member for member in self.members if member.public_key == public_key), None)

    def removed_by_key(self, public_key: str) -> RemovedMember | None:
        """The removed member that held `public_key`, if one did."""
        return next((gone for gone in self.removed if gone.member.public_key == public_key), None)

    def _holders(self) -> list[Member]:
        """Every member that held keys, current or removed."""
        return [*self.members, *(gone.member for gone in self.removed)]

    def former_keys(self) -> dict[str, RemovedMember]:
        """Each key no longer accepted, with when and where it stopped counting: removed members' keys, and every
        key a member (current or removed) retired by a rotation, as the removal of that key alone."""
        former = {gone.member.public_key: gone for gone in self.removed}
        for holder in self._holders():
            former.update({retired.public_key: holder.as_retired(retired) for retired in holder.retired_keys})
        return former

    def key_beginnings(self) -> dict[str, RetiredKey]:
        """Each key a rotation gave a member (current or removed), with the retirement of the key it replaced: where
        and when it began to count."""
        began = {}
        for holder in self._holders():
            keys = [retired.public_key for retired in holder.retired_keys] + [holder.public_key]
            began.update({key: retired for key, retired in zip(keys[1:], holder.retired_keys)})
        return began

    def retirements(self) -> list[tuple[Member, RetiredKey]]:
        """Every key retired by a rotation, with the member (current or removed) that held it, oldest first each."""
        return [(holder, retired) for holder in self._holders() for retired in holder.retired_keys]

    def retired_key_of(self, public_key: str) -> tuple[Member, RetiredKey] | None:
        """The member (current or removed) that retired `public_key` by a rotation, and its retirement."""
        return next(((holder, retired) for holder, retired in self.retirements() if retired.public_key == public_key),
                    None)

    def with_rotated_key(self, name: str, public_key: str, *, retired_at: datetime,
                         cuts: Sequence[RemovalCut] = ()) -> "Roster":
        """The roster with member `name` holding `public_key` and its key until now retired at `retired_at`, where
        the rotation events went (`cuts`). The steward's own `system` key too: its old key signed those events, so
        the log chains it to the new one."""
        member = self.by_name(name)
        if member is None:
            gone = any(removed.member.name == name for removed in self.removed)
            raise RosterError(f"{name!r} was removed from the community: its key is retired for good" if gone
                              else f"no member named {name!r} is in the roster")
        self._check_new_key(public_key)
        retired = RetiredKey(public_key=member.public_key, retired_at=retired_at, cuts=list(cuts))
        rotated = member.model_copy(update={"public_key": check_public_key(public_key),
                                            "retired_keys": [*member.retired_keys, retired]})
        return self.model_copy(update={"members": [rotated if kept.name == name else kept for kept in self.members]})

    def _check_new_key(self, public_key: str) -> None:
        """RosterError when `public_key` was ever held in this community."""
        holder = self.by_key(public_key)
        if holder is not None:
            raise RosterError(f"that public key already belongs to {holder.name!r}")
        gone = self.removed_by_key(public_key)
        if gone is not None:
            raise RosterError(f"that public key belonged to {gone.member.name!r}, removed at "
                              f"{gone.removed_at:%Y-%m-%d %H:%M:%S} UTC; a member coming back needs a new key")
        retired = self.retired_key_of(public_key)
        if retired is not None:
            raise RosterError(f"that public key is one {retired[0].name!r} retired at "
                              f"{retired[1].retired_at:%Y-%m-%d %H:%M:%S} UTC; a retired key never counts again")

    def with_member(self, member: Member) -> "Roster":
        if self.by_name(member.name) is not None:
            raise RosterError(f"a member named {member.name!r} is already in the roster")
        self._check_new_key(member.public_key)
        gone = next((removed for removed in self.removed if removed.member.name == member.name), None)
        if gone is not None:
            # Its node id, shards, reputation and signed events are that member's: a new member must not inherit them.
            raise RosterError(f"{member.name!r} was a member removed at {gone.removed_at:%Y-%m-%d %H:%M:%S} UTC, "
                              "whose node, shards and record keep that name; choose another name")
        return self.model_copy(update={"members": [*self.members, member]})

    def without_member(self, name: str, *, removed_at: datetime, cuts: Sequence[RemovalCut] = ()) -> "Roster":
        """The roster with `name` moved to the removed members, its removal events at `cuts`; the steward's `system`
        key stays."""
        member = self.by_name(name)
        if member is None:
            raise RosterError(f"no member named {name!r} is in the roster")
        if member.role == "system":
            raise RosterError(f"{name!r} is the steward's system key, which the community cannot be without")
        return self.model_copy(update={
            "members": [kept for kept in self.members if kept.name != name],
            "removed": [*self.removed, RemovedMember(member=member, removed_at=removed_at, cuts=list(cuts))]})

    @classmethod
    def load(cls, path: Path) -> "Roster":
        try:
            return cls.model_validate_json(path.read_bytes())
        except OSError as error:
            raise RosterError(f"cannot read the roster {path}: {error.strerror}") from None
        except ValidationError as error:
            first = error.errors()[0]
            if first["loc"] == ("format",) and isinstance(first["input"], int) and first["input"] > ROSTER_FORMAT:
                raise RosterError(f"{path} is a roster of format {first['input']}, newer than this hearth reads "
                                  f"(format {ROSTER_FORMAT}): upgrade it") from None
            where = ".".join(str(part) for part in first["loc"]) or "(file)"
            raise RosterError(f"{path} is not a hearth roster: {where}: {first['msg']}") from None

    def save(self, path: Path) -> None:
        """Replace the file atomically, so a reader never sees half a roster, mode 0600 (write_private_file): it
        holds only public keys, but names a household's members and machines, and every member has its own copy."""
        path.parent.mkdir(mode=PRIVATE_FOLDER_MODE, parents=True, exist_ok=True)  # a member's copy: left as it is
        write_private_file(path, (json.dumps(self.model_dump(mode="json"), indent=2) + "\n").encode())


def new_roster(community: str) -> Roster:
    try:
        return Roster(community=community, created_at=datetime.now(timezone.utc))
    except ValidationError as error:
        first = error.errors()[0]
        raise RosterError(f"the community's name: {first['msg']}") from None


def new_member(name: str, role: Role, public_key: str, trust: TrustLevel | None = None) -> Member:
    try:
        return Member(name=name, role=role, trust=trust or DEFAULT_TRUST[role], public_key=public_key,
                      added_at=datetime.now(timezone.utc))
    except ValidationError as error:
        first = error.errors()[0]
        raise RosterError(f"{'.'.join(str(part) for part in first['loc'])}: {first['msg']}") from None


def seed_path(community_dir: Path, name: str) -> Path:
    return community_dir / KEYS_DIR / f"{name}{SEED_SUFFIX}"
