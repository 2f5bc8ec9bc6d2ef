"""The steward's removal of a member as the event log records it: a `member.removed` signed with the system key,
published on each event stream before the roster changes, whose positions (the cuts) the roster then keeps; the
publisher is handed in as a function so the logic is tested without a broker."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from hearth.events.streams import ALL_STREAMS, MEMBER_REMOVAL_SUBJECTS
from hearth.trust.roster import SYSTEM_MEMBER, Member, RemovalCut, RosterError

if TYPE_CHECKING:
    from hearth.events.models import MemberRemoved
    from hearth.services.common.config import NatsSettings
    from hearth.trust.community import Community
    from hearth.trust.keys import MemberKey

log = logging.getLogger(__name__)

# Publishes one signed event on a subject and says where and when the broker stored it: (stream, sequence, the
# broker's storage time, None when it could not be read back).
Publish = Callable[["MemberRemoved", str], Awaitable[tuple[str, int, datetime | None]]]


class RemovalNotPublished(Exception):
    """No stream took the removal event: nothing was changed."""


@dataclass(frozen=True)
class PublishedRemoval:
    """Where the removal went in (`cuts`), and why each stream it did not go in refused it."""

    cuts: list[RemovalCut] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)


def removal_event(member: Member, stream: str, steward_key: MemberKey) -> MemberRemoved:
    """The signed event that cuts `member` off on `stream`."""
    from hearth.events.models import MemberRemoved
    from hearth.events.signing import sign_event

    event = MemberRemoved(node_id=SYSTEM_MEMBER, member=member.name, public_key=member.public_key, stream=stream)
    return sign_event(event, steward_key)  # type: ignore[return-value]


async def publish_removal(member: Member, steward_key: MemberKey, publish: Publish,
                          streams: tuple[str, ...] = ALL_STREAMS) -> PublishedRemoval:
    """Publish `member`'s removal on every stream (whichever it could write to: a removal costs one small event
    each); RemovalNotPublished when no stream took it."""
    published = PublishedRemoval()
    for stream in streams:
        event = removal_event(member, stream, steward_key)
        try:
            stored_in, seq, stored_at = await publish(event, MEMBER_REMOVAL_SUBJECTS[stream])
        except Exception as error:  # that stream refused or did not answer: the others may still take it
            published.failures[stream] = str(error) or type(error).__name__
            continue
        if stored_in != stream:
            published.failures[stream] = f"the broker stored it in {stored_in}"
            continue
        published.cuts.append(RemovalCut(stream=stream, seq=seq, event_id=event.event_id, stored_at=stored_at))
    if not published.cuts:
        reasons = "; ".join(f"{stream}: {why}" for stream, why in published.failures.items())
        raise RemovalNotPublished(f"no event stream took the removal ({reasons})")
    return published


@contextlib.asynccontextmanager
async def steward_publisher(nats: NatsSettings, system_key: Path) -> AsyncIterator[Publish]:
    """A Publish over one connection to `nats.url` as the steward (`system_key`), closed on leaving;
    BrokerUnreachable when the broker cannot be reached."""
    from hearth.events.publish import publish_event
    from hearth.services.broker.connection import close_quietly, connect_nats

    settings = nats.model_copy(update={"creds_file": system_key})
    connection = await connect_nats(settings.url, name="hearth steward", settings=settings)

    async def publish(event: MemberRemoved, subject: str) -> tuple[str, int, datetime | None]:
        js = connection.jetstream()
        ack = await publish_event(js, event, subject=subject)
        # The ack says where, not when: the stored message says when, by the broker's clock (a request bounded by
        # the JetStream context's timeout). Stored it is: a failed read-back keeps the cut's position without it.
        try:
            stored = await js.get_msg(ack.stream, ack.seq)
        except Exception as error:  # a timeout or an API error: the position alone still cuts
            log.warning("the removal stored as %s #%d could not be read back (%s): its cut holds no storage time",
                        ack.stream, ack.seq, error)
            return ack.stream, ack.seq, None
        return ack.stream, ack.seq, stored.time

    try:
        yield publish
    finally:
        await close_quietly(connection, settings.close_timeout_s)


async def publish_removal_as_steward(member: Member, steward_key: MemberKey, nats: NatsSettings,
                                     system_key: Path) -> PublishedRemoval:
    async with steward_publisher(nats, system_key) as publish:
        return await publish_removal(member, steward_key, publish)


def publish_community_removal(community: Community, name: str, nats_url: str | None) -> PublishedRemoval:
    """Publish the removal of `community`'s member `name` on the community's broker (`nats_url`, else [nats] url) with
    the steward's system key; KeyFileError without that key, BrokerUnreachable, RemovalNotPublished."""
    from hearth.services.common.config import load_settings
    from hearth.services.common.lifecycle import run_event_loop
    from hearth.trust.keys import KeyFileError

    if not community.system_key_path.is_file():
        raise KeyFileError(f"{community.system_key_path} does not exist: only the steward, with the community's "
                           "system key, publishes a removal (or give --offline)")
    member = community.roster().by_name(name)
    if member is None:
        raise RosterError(f"no member named {name!r} is in the roster")
    nats = load_settings().nats
    nats = nats.model_copy(update={"url": nats_url or nats.url, "roster_file": community.roster_path})
    return run_event_loop(publish_removal_as_steward(member, community.system_key(), nats, community.system_key_path))
