"""The steward's removal of a member's key as the event log records it: a `member.removed` (or, for a key rotation,
a `member.key_rotated`, the removal of the old key alone) signed with the system key, published on each event stream
before the roster changes (or, where an earlier run already published one, found there), whose positions (the cuts)
the roster then keeps; on a stream whose log lacks the member's earlier changes, those go first, in the order a reader
meets them (what a stream lacks is hearth/services/community_pending.py's to say), and where one is not taken, nothing
after it. The streams are handed in as an object so the logic is tested without a broker."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from hearth.events.streams import ALL_STREAMS, MEMBER_REMOVAL_SUBJECTS, streams_missing
from hearth.trust.roster import SYSTEM_MEMBER, Member, RemovalCut, RosterError

if TYPE_CHECKING:
    from nats.js import JetStreamContext

    from hearth.events.consume import SkippedMessage, StoredEvent
    from hearth.events.models import MemberChange, MemberRemoved
    from hearth.events.signing import EventVerifier
    from hearth.services.common.config import HearthSettings, NatsSettings
    from hearth.trust.community import Community
    from hearth.trust.keys import MemberKey
    from hearth.trust.unpublished_changes import MemberChangeKind

log = logging.getLogger(__name__)

# How long reading the removals a stream already holds may take, before that stream counts as not taking this one.
removal_lookup_timeout_s = 10.0


class RemovalLog(Protocol):
    """The event streams as the steward's removal uses them."""

    where: str  # the broker, for the line that says a stream is missing

    async def missing(self, streams: Sequence[str]) -> list[str]:
        """Which of `streams` the broker does not hold."""

    async def removals(self, stream: str) -> list[StoredEvent | SkippedMessage]:
        """The messages `stream` holds on its removal subject, oldest first."""

    async def publish(self, event: MemberChange, subject: str) -> tuple[str, int, datetime | None]:
        """Publish one signed event on `subject`: where and when the broker stored it (stream, sequence, the
        broker's storage time, None when it could not be read back)."""


@dataclass(frozen=True)
class LogChange:
    """One change of `member` a stream's log lacks: its kind, what it is in words, and what signs its event there."""

    member: str
    kind: MemberChangeKind
    what: str
    event: Callable[[str, MemberKey], MemberChange]


@dataclass
class StreamCatchUp:
    """What one stream was given (`published`: each change with its place), which members' changes it held already
    (`held`), the change it did not take and why (`refused`; those after it, `waiting`, were not tried: a reader must
    meet them in order), why it could not be read (`unread`: nothing was published there), and what it lacks that
    cannot be published (`unpublishable`)."""

    published: list[tuple[LogChange, int]] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    refused: tuple[LogChange, str] | None = None
    waiting: list[LogChange] = field(default_factory=list)
    unread: str | None = None
    unpublishable: list[str] = field(default_factory=list)

    def lacking(self) -> set[str]:
        """The members some change of which this stream still lacks."""
        return {change.member for change in ([self.refused[0]] if self.refused else []) + self.waiting}


# The changes of a current member that a stream's log lacks (its members subject as read), which a reader must meet
# before the one this run publishes: its addition, its earlier keys' rotations.
EarlierChanges = Callable[[Member, "Sequence[StoredEvent | SkippedMessage]", "EventVerifier"], list[LogChange]]


class RemovalNotPublished(Exception):
    """No stream took the removal event: nothing was changed."""


class EarlierRemovalDiffers(Exception):
    """A stream already holds an earlier run's removal of the key that is not the one this run stands for (a rotation
    naming another new key): nothing was published or changed."""


@dataclass
class PublishedRemoval:
    """Where the removal is in each stream that holds it (`cuts`), which of those an earlier run had published
    (`found`) and since when by the steward's clock (`found_since`), why each stream without it refused it, and
    what each stream this run published on was given first of the member's earlier changes its log lacked."""

    cuts: list[RemovalCut] = field(default_factory=list)
    found: list[str] = field(default_factory=list)
    found_since: datetime | None = None
    failures: dict[str, str] = field(default_factory=dict)
    earlier: dict[str, StreamCatchUp] = field(default_factory=dict)  # the member's earlier changes each was given


# The signed event that cuts `member`'s key off on `stream`, signed with the steward's key.
RemovalEventMaker = Callable[[Member, str, "MemberKey"], "MemberRemoved"]


def removal_event(member: Member, stream: str, steward_key: MemberKey) -> MemberRemoved:
    """The signed event that cuts `member` off on `stream`."""
    from hearth.events.models import MemberRemoved
    from hearth.events.signing import sign_event

    event = MemberRemoved(node_id=SYSTEM_MEMBER, member=member.name, public_key=member.public_key, stream=stream)
    return sign_event(event, steward_key)  # type: ignore[return-value]


# Why an earlier run's removal of the key, found on a stream, is not the one this run stands for; None: it is.
EarlierRemovalCheck = Callable[["MemberRemoved"], "str | None"]


def any_removal(earlier: MemberRemoved) -> str | None:
    """A removal stands for any earlier removal of the key."""
    return None


def rotation_differs(new_public_key: str) -> EarlierRemovalCheck:
    """What says why an earlier run's rotation does not name `new_public_key`: the roster must name the key the log's
    rotation does (its chain: the steward's own rotation is signed by the old key naming the new one)."""

    def check(earlier: MemberRemoved) -> str | None:
        named = getattr(earlier, "new_public_key", None)
        if named is None or named == new_public_key:
            return None
        return (f"already rotates {earlier.member}'s key to {named} (an earlier run's), not to {new_public_key}, "
                f"and the roster must name the key the log does: run it again with --public-key {named} (then, if "
                "no one holds that key's seed, rotate the key once more)")

    return check


def rotation_events(new_public_key: str) -> RemovalEventMaker:
    """What makes the signed event that retires `member`'s key on `stream` for `new_public_key`."""

    def rotation_event(member: Member, stream: str, steward_key: MemberKey) -> MemberRemoved:
        from hearth.events.models import MemberKeyRotated
        from hearth.events.signing import sign_event

        event = MemberKeyRotated(node_id=SYSTEM_MEMBER, member=member.name, public_key=member.public_key,
                                 new_public_key=new_public_key, stream=stream)
        return sign_event(event, steward_key)  # type: ignore[return-value]

    return rotation_event


def first_removal(member: Member, stream: str, messages: Sequence[StoredEvent | SkippedMessage],
                  verifier: EventVerifier) -> StoredEvent | None:
    """The first removal of `member`'s key that `stream` holds and a projection would apply (a steward's, signed,
    marking this stream): the one that cuts it off there, whatever was published after it."""
    from hearth.events.consume import StoredEvent
    from hearth.events.models import MemberRemoved
    from hearth.events.signing import StreamPosition

    for message in messages:
        if not isinstance(message, StoredEvent) or not isinstance(message.event, MemberRemoved):
            continue
        if message.event.public_key != member.public_key:
            continue
        if verifier.rejection(message.event, received_at=message.time, stored_data=message.data,
                              position=StreamPosition(stream, message.seq, message.subject)) is None:
            return message
    return None


async def publish_member_change(event: MemberChange, stream: str, member_log: RemovalLog,
                                published: PublishedRemoval) -> None:
    """Put the signed `event` (a member's removal, rotation or addition) on `stream`'s members subject: its place there
    goes to `published.cuts`, or why that stream did not take it to `published.failures` (the others may still)."""
    try:
        stored_in, seq, stored_at = await member_log.publish(event, MEMBER_REMOVAL_SUBJECTS[stream])
    except Exception as error:  # that stream refused or did not answer: the others may still take it
        published.failures[stream] = str(error) or type(error).__name__
        return
    if stored_in != stream:
        published.failures[stream] = f"the broker stored it in {stored_in}"
        return
    published.cuts.append(RemovalCut(stream=stream, seq=seq, event_id=event.event_id, stored_at=stored_at))


async def publish_in_order(changes: Sequence[LogChange], stream: str, steward_key: MemberKey, member_log: RemovalLog,
                           done: StreamCatchUp) -> None:
    """Put `changes` on `stream` one after the other (each with its place in `done.published`), stopping at the first
    it does not take (`done.refused`; the rest, `done.waiting`, are not tried: a reader must meet them in order)."""
    for number, change in enumerate(changes):
        published = PublishedRemoval()
        await publish_member_change(change.event(stream, steward_key), stream, member_log, published)
        if published.failures:
            done.refused, done.waiting = (change, published.failures[stream]), list(changes[number + 1:])
            return
        done.published.append((change, published.cuts[0].seq))


async def publish_removal(member: Member, steward_key: MemberKey, removal_log: RemovalLog, verifier: EventVerifier,
                          streams: tuple[str, ...] = ALL_STREAMS,
                          make_event: RemovalEventMaker = removal_event,
                          differs: EarlierRemovalCheck = any_removal,
                          earlier: EarlierChanges | None = None) -> PublishedRemoval:
    """Put `member`'s removal (`make_event`'s: a rotation retires its key alone) on every stream (whichever it could
    write to: a removal costs one small event each), publishing it only where no earlier run did: a projection cuts
    at the first removal of a key, so the roster must too. Before it, a stream gets what `earlier` says its log lacks
    of the member's earlier changes, in order; one it does not take fails the removal there (nothing after it goes:
    a reader with an older roster could not follow it). StreamsMissing when a stream does not exist (nothing
    published); EarlierRemovalDiffers (nothing published) when `differs` says why an earlier run's event is not the
    one this run stands for (a rotation naming another new key); RemovalNotPublished when no stream took it."""
    missing = await removal_log.missing(streams)
    if missing:
        raise streams_missing(missing, removal_log.where)
    published = PublishedRemoval()
    unpublished: dict[str, list[StoredEvent | SkippedMessage]] = {}
    # Every stream is read before any is written: an earlier run's event this one would contradict refuses it whole.
    for stream in streams:
        try:
            messages = await removal_log.removals(stream)
            found = first_removal(member, stream, messages, verifier)
        except Exception as error:  # publishing blind could move the cut past the member's events since
            published.failures[stream] = f"could not read the removals it holds ({str(error) or type(error).__name__})"
            continue
        if found is None:
            unpublished[stream] = messages
            continue
        reason = differs(found.event)  # type: ignore[arg-type]
        if reason is not None:
            raise EarlierRemovalDiffers(f"{stream} #{found.seq} {reason}")
        published.cuts.append(RemovalCut(stream=stream, seq=found.seq, event_id=found.event.event_id,
                                         stored_at=found.time))
        published.found.append(stream)
        since = found.event.occurred_at
        published.found_since = min(published.found_since or since, since)
    for stream, messages in unpublished.items():
        if earlier is not None:
            done = published.earlier[stream] = StreamCatchUp()
            await publish_in_order(earlier(member, messages, verifier), stream, steward_key, removal_log, done)
            if done.refused is not None:
                change, why = done.refused
                published.failures[stream] = (f"{change.what}, which a reader must meet first, was not taken ({why}): "
                                              "nothing after it was published there")
                continue
        await publish_member_change(make_event(member, stream, steward_key), stream, removal_log, published)
    if not published.cuts:
        reasons = "; ".join(f"{stream}: {why}" for stream, why in published.failures.items())
        raise RemovalNotPublished(f"no event stream took the removal ({reasons})")
    return published


class BrokerRemovalLog:
    """A RemovalLog over one JetStream connection as the steward."""

    def __init__(self, js: JetStreamContext, where: str) -> None:
        self._js = js
        self.where = where

    async def missing(self, streams: Sequence[str]) -> list[str]:
        from hearth.events.streams import missing_streams

        return await missing_streams(self._js, streams)

    async def removals(self, stream: str) -> list[StoredEvent | SkippedMessage]:
        from hearth.events.consume import read_stream

        async def read() -> list[StoredEvent | SkippedMessage]:
            async with contextlib.aclosing(read_stream(self._js, stream, subject_filter=MEMBER_REMOVAL_SUBJECTS[stream],
                                                       follow=False)) as messages:
                return [message async for message in messages]

        # asyncio.timeout, not wait_for: on 3.11 wait_for drops a cancellation that lands as the read ends.
        async with asyncio.timeout(removal_lookup_timeout_s):
            return await read()

    async def publish(self, event: MemberChange, subject: str) -> tuple[str, int, datetime | None]:
        from hearth.events.publish import publish_event

        ack = await publish_event(self._js, event, subject=subject)
        # The ack says where, not when: the stored message says when, by the broker's clock (a request bounded by
        # the JetStream context's timeout). Stored it is: a failed read-back keeps the cut's position without it.
        try:
            stored = await self._js.get_msg(ack.stream, ack.seq)
        except Exception as error:  # a timeout or an API error: the position alone still cuts
            log.warning("the removal stored as %s #%d could not be read back (%s): its cut holds no storage time",
                        ack.stream, ack.seq, error)
            return ack.stream, ack.seq, None
        return ack.stream, ack.seq, stored.time


@contextlib.asynccontextmanager
async def steward_removal_log(nats: NatsSettings, system_key: Path) -> AsyncIterator[RemovalLog]:
    """A RemovalLog over one connection to `nats.url` as the steward (`system_key`), closed on leaving;
    BrokerUnreachable when the broker cannot be reached."""
    from hearth.services.broker.connection import steward_connection

    async with steward_connection(nats, system_key) as connection:
        yield BrokerRemovalLog(connection.jetstream(), nats.url)


async def publish_removal_as_steward(member: Member, steward_key: MemberKey, verifier: EventVerifier,
                                     nats: NatsSettings, system_key: Path,
                                     make_event: RemovalEventMaker = removal_event,
                                     differs: EarlierRemovalCheck = any_removal,
                                     earlier: EarlierChanges | None = None) -> PublishedRemoval:
    async with steward_removal_log(nats, system_key) as removal_log:
        return await publish_removal(member, steward_key, removal_log, verifier, make_event=make_event,
                                     differs=differs, earlier=earlier)


def publish_community_removal(community: Community, name: str, nats_url: str | None,
                              settings: HearthSettings, make_event: RemovalEventMaker = removal_event,
                              differs: EarlierRemovalCheck = any_removal,
                              earlier: EarlierChanges | None = None) -> PublishedRemoval:
    """Put the removal of `community`'s member `name` (or of its key alone: `make_event`) on the community's broker
    (`nats_url`, else [nats] url) with the steward's system key, after what `earlier` says each stream lacks of the
    member's earlier changes; KeyFileError without that key, BrokerUnreachable,
    StreamsMissing, EarlierRemovalDiffers, RemovalNotPublished."""
    from hearth.events.signing import EventVerifier
    from hearth.services.common.lifecycle import run_event_loop
    from hearth.trust.keys import KeyFileError

    if not community.system_key_path.is_file():
        raise KeyFileError(f"{community.system_key_path} does not exist: only the steward, with the community's "
                           "system key, publishes a removal or a key rotation (or give --offline)")
    roster = community.roster()
    member = roster.by_name(name)
    if member is None:
        raise RosterError(f"no member named {name!r} is in the roster")
    nats = settings.nats.model_copy(update={"url": nats_url or settings.nats.url,
                                            "roster_file": community.roster_path})
    # The roster as it stands, with the member still in it: an earlier run's removal verifies as a projection's would.
    verifier = EventVerifier(roster, max_clock_skew_s=settings.events.max_clock_skew_s)
    return run_event_loop(publish_removal_as_steward(member, community.system_key(), verifier, nats,
                                                     community.system_key_path, make_event, differs, earlier))
