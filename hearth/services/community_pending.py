"""The steward's publishing of what the event log lacks of the roster's member changes (`hearth community
publish-pending`), after an `add`, `remove` or `rotate-key` whose event some stream did not take (--offline, a broker
out of reach, a stream refusing): each stream's members subject is read and judged as a projection judges it
(hearth/events/logged_keys.py), then the signed events it lacks are published there in the order a reader must meet
them: a member's addition (under its first key) where the stream names the member nowhere, the rotation of each key
the roster retired that the stream holds no removal of, and a removed member's removal; never one the stream holds,
so it can be run again and again; `remove` and `rotate-key` publish the same of their member first (earlier_changes),
so their change never overtakes one the log lacks. The steward's rotation of its own key cannot be published later
(the retired key signs it) and is said. The roster does not change: where it cuts a removal or a retirement by the
steward's clock, that stays its word for the readers holding it. The streams are handed in as an object so the logic
is tested without a broker."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hearth.events.streams import ALL_STREAMS, streams_missing
from hearth.services.community_addition import addition_event
from hearth.services.community_removal import (
    LogChange, RemovalLog, StreamCatchUp, publish_in_order, removal_event, rotation_events, steward_removal_log,
)
from hearth.trust.roster import SYSTEM_MEMBER, Member, Roster, RosterError

if TYPE_CHECKING:
    from hearth.events.consume import SkippedMessage, StoredEvent
    from hearth.events.signing import EventVerifier
    from hearth.services.common.config import HearthSettings
    from hearth.trust.community import Community
    from hearth.trust.keys import MemberKey


def held_changes(messages: Sequence[StoredEvent | SkippedMessage], verifier: EventVerifier) -> tuple[set[str],
                                                                                                      set[str]]:
    """The members a stream's verified member changes name, and the keys its verified removals and rotations retired
    (`messages`: its members subject, oldest first)."""
    from hearth.events.consume import StoredEvent
    from hearth.events.logged_keys import LoggedKeys
    from hearth.events.models import MemberChange, MemberRemoved

    logged, names, retired = LoggedKeys(), set(), set()
    for message in messages:
        if not isinstance(message, StoredEvent) or not isinstance(message.event, MemberChange):
            continue
        if logged.rejection(verifier, message) is not None:
            continue
        logged.record(message.event)
        names.add(message.event.member)
        if isinstance(message.event, MemberRemoved):
            retired.add(message.event.public_key)
    return names, retired


def member_changes(holder: Member, *, removed: bool, names: set[str], retired: set[str]) -> list[LogChange]:
    """`holder`'s changes a stream lacks (it names `names` and retired `retired`), in the order a reader meets them."""
    keys = [key.public_key for key in holder.retired_keys] + [holder.public_key]
    at_key = [holder.model_copy(update={"public_key": key, "retired_keys": []}) for key in keys]
    changes = []
    if not removed and holder.name not in names:
        first = at_key[0]
        changes.append(LogChange(holder.name, "addition", f"the addition of {holder.name}",
                                 lambda stream, key: addition_event(first, stream, key)))
    for old, new in zip(at_key, keys[1:]):
        if old.public_key not in retired:
            changes.append(LogChange(holder.name, "key rotation", f"the rotation of {holder.name}'s key to {new}",
                                     lambda stream, key, old=old, new=new: rotation_events(new)(old, stream, key)))
    if removed and holder.public_key not in retired:
        changes.append(LogChange(holder.name, "removal", f"the removal of {holder.name}",
                                 lambda stream, key: removal_event(holder, stream, key)))
    return changes


def lacking_changes(roster: Roster, names: set[str], retired: set[str],
                    only: str | None = None) -> tuple[list[LogChange], list[str], list[str]]:
    """What a stream that names `names` and retired `retired` lacks of the roster's changes (of member `only`, else
    every member's): the changes to publish in order, the members it holds every change of, and what it lacks that
    cannot be published (the steward's rotations of its own key, which the retired key signs)."""
    changes, held, unpublishable = [], [], []
    holders = [(member, False) for member in roster.members] + [(gone.member, True) for gone in roster.removed]
    for holder, removed in holders:
        if only is not None and holder.name != only:
            continue
        if holder.name == SYSTEM_MEMBER:
            unpublishable += [f"the steward's rotation of its own key {key.public_key}" for key in holder.retired_keys
                              if key.public_key not in retired]
            continue
        lacking = member_changes(holder, removed=removed, names=names, retired=retired)
        changes += lacking
        if not lacking:
            held.append(f"{holder.name} (removed)" if removed else holder.name)
    return changes, held, unpublishable


def earlier_changes(member: Member, messages: Sequence[StoredEvent | SkippedMessage],
                    verifier: EventVerifier) -> list[LogChange]:
    """What a stream (its members subject: `messages`) lacks of current member `member`'s changes, which `remove` and
    `rotate-key` publish there before their own (community_removal.EarlierChanges): none of the steward's, whose
    rotations of its own key only the retired key signs."""
    if member.name == SYSTEM_MEMBER:
        return []
    names, retired = held_changes(messages, verifier)
    return member_changes(member, removed=False, names=names, retired=retired)


async def publish_pending(roster: Roster, steward_key: MemberKey, member_log: RemovalLog, verifier: EventVerifier,
                          streams: tuple[str, ...] = ALL_STREAMS, only: str | None = None) -> dict[str, StreamCatchUp]:
    """Give each of `streams` what its log lacks of the roster's member changes (lacking_changes), stopping on a
    stream at the first change it does not take. StreamsMissing (nothing published) when a stream does not exist."""
    missing = await member_log.missing(streams)
    if missing:
        raise streams_missing(missing, member_log.where)
    caught_up = {}
    for stream in streams:
        caught_up[stream] = done = StreamCatchUp()
        try:
            names, retired = held_changes(await member_log.removals(stream), verifier)
        except Exception as error:  # publishing blind could add a member twice, or rotate a key out of order
            done.unread = str(error) or type(error).__name__
            continue
        changes, done.held, done.unpublishable = lacking_changes(roster, names, retired, only)
        await publish_in_order(changes, stream, steward_key, member_log, done)
    return caught_up


def publish_community_pending(community: Community, only: str | None, nats_url: str | None,
                              settings: HearthSettings) -> dict[str, StreamCatchUp]:
    """Publish what the community's broker (`nats_url`, else [nats] url) lacks of its roster's member changes (of
    member `only`, else every member's) with the steward's system key; KeyFileError without that key, RosterError for
    a member the roster never held, BrokerUnreachable, StreamsMissing."""
    from hearth.events.signing import EventVerifier
    from hearth.services.common.lifecycle import run_event_loop
    from hearth.trust.keys import KeyFileError

    if not community.system_key_path.is_file():
        raise KeyFileError(f"{community.system_key_path} does not exist: only the steward, with the community's "
                           "system key, publishes member changes")
    roster = community.roster()
    if only is not None and roster.by_name(only) is None and all(gone.member.name != only for gone in roster.removed):
        raise RosterError(f"no member named {only!r} is in the roster, nor was one removed")
    nats = settings.nats.model_copy(update={"url": nats_url or settings.nats.url,
                                            "roster_file": community.roster_path})
    verifier = EventVerifier(roster, max_clock_skew_s=settings.events.max_clock_skew_s)

    async def publish() -> dict[str, StreamCatchUp]:
        async with steward_removal_log(nats, community.system_key_path) as member_log:
            return await publish_pending(roster, community.system_key(), member_log, verifier, only=only)

    return run_event_loop(publish())
