"""What a process with no read model asks of the keys the event logs and its kept file retired, named and added
(hearth/services/common/logged_steward_keys.py), built once from what was read and kept as it is until a new removal,
rotation or addition is read: each key and member indexed, so that a signed call's check and an orchestrator step's
question of one key or member is a lookup, not a pass over every change ever read."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from hearth.events.logged_keys import LoggedKeys
from hearth.events.member_additions import LoggedAddition
from hearth.events.member_keys import NamedMemberKey

NamedAddition = tuple[str, LoggedAddition]  # (the key it added, the addition), as member_by_additions reads it
Entry = TypeVar("Entry")


def _grouped(entries: Iterable[Entry], key_of: Callable[[Entry], str]) -> dict[str, tuple[Entry, ...]]:
    grouped: dict[str, list[Entry]] = {}
    for entry in entries:
        grouped.setdefault(key_of(entry), []).append(entry)
    return {key: tuple(group) for key, group in grouped.items()}


@dataclass(frozen=True)
class LoggedKeyViews:
    """The keys the logs (every stream's) and the kept file retired, and the steward keys, member keys and members
    they named, as StewardKeysFromTheLog gives them; the `..._of` and `..._bearing_on` lookups return what
    hearth/events/member_keys.py and member_additions.py read of one key or member, every entry they would look at
    (so they answer as they would from every entry)."""

    retired: frozenset[str] = frozenset()
    steward_keys: tuple[tuple[str, str], ...] = ()  # (the key, the one it succeeded)
    member_keys: tuple[NamedMemberKey, ...] = ()
    additions: tuple[NamedAddition, ...] = ()
    _member_keys_naming: dict[str, tuple[NamedMemberKey, ...]] = field(default_factory=dict, repr=False)
    _member_keys_of: dict[str, tuple[NamedMemberKey, ...]] = field(default_factory=dict, repr=False)
    _additions_of_key: dict[str, tuple[NamedAddition, ...]] = field(default_factory=dict, repr=False)
    _additions_of_member: dict[str, tuple[NamedAddition, ...]] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, kept: LoggedKeys, logged: LoggedKeys) -> LoggedKeyViews:
        """The views of what the kept file taught (`kept`) and the streams' logs did (`logged`, which wins where
        both name a steward key at one position)."""
        steward_keys = dict(kept.steward_keys)
        steward_keys.update(logged.steward_keys)
        member_keys = (*kept.named_member_keys(), *logged.named_member_keys())
        additions = (*kept.named_additions(), *logged.named_additions())
        return cls(retired=frozenset(key for _, key in logged.removed | kept.removed),
                   steward_keys=tuple((key, succeeded) for (_, key), succeeded in steward_keys.items()),
                   member_keys=member_keys, additions=additions,
                   _member_keys_naming=_grouped(member_keys, lambda named: named[0]),
                   _member_keys_of=_grouped(member_keys, lambda named: named[2]),
                   _additions_of_key=_grouped(additions, lambda added: added[0]),
                   _additions_of_member=_grouped(additions, lambda added: added[1].member))

    def member_keys_of(self, member: str) -> tuple[NamedMemberKey, ...]:
        """The rotations of `member`'s key the logs named: all current_key_by_logs reads for it."""
        return self._member_keys_of.get(member, ())

    def member_keys_bearing_on(self, public_key: str) -> list[NamedMemberKey]:
        """Each rotation naming `public_key`, with every rotation of each member those name: all member_by_logs
        reads for it."""
        naming = self._member_keys_naming.get(public_key, ())
        members = {member for _, _, member in naming}
        return [*naming, *(named for member in members for named in self.member_keys_of(member))]

    def additions_bearing_on(self, public_key: str) -> list[NamedAddition]:
        """Each addition of `public_key`, with every addition of each member those name: all member_by_additions
        reads for it."""
        of_key = self._additions_of_key.get(public_key, ())
        members = {addition.member for _, addition in of_key}
        return [*of_key, *(added for member in members for added in self._additions_of_member.get(member, ()))]

    def additions_bearing_on_signer(self, public_key: str) -> list[NamedAddition]:
        """additions_bearing_on(`public_key`), with those bearing on each member the rotations naming it name: all
        member_by_logs (a rotated key of a member only the logs added) and member_by_additions read for a signer."""
        rotated = {member for _, _, member in self._member_keys_naming.get(public_key, ())}
        return [*self.additions_bearing_on(public_key),
                *(added for member in rotated for added in self.additions_bearing_on_member(member))]

    def additions_bearing_on_member(self, member: str) -> list[NamedAddition]:
        """Each addition of `member`, with what additions_bearing_on gives for each key those name: all
        member_named_by_additions reads for it."""
        of_member = self._additions_of_member.get(member, ())
        keys = {key for key, _ in of_member}
        return [*of_member, *(added for key in keys for added in self.additions_bearing_on(key))]
