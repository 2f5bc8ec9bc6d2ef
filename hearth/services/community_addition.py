"""The steward's addition of a member as the event log records it: a `member.added` (name, role, trust, public key)
signed with the system key, published on each event stream's members subject once the roster holds the member, so
every household's processes take the member from the log before their roster copy names it
(hearth/events/member_additions.py); the streams are handed in as an object so the logic is tested without a broker."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hearth.events.streams import ALL_STREAMS, streams_missing
from hearth.services.community_removal import (
    PublishedRemoval, RemovalLog, publish_member_change, steward_removal_log,
)
from hearth.trust.roster import SYSTEM_MEMBER, Member

# How long `add` tries the configured broker when no --nats names one.
unnamed_broker_connect_timeout_s = 2.0

if TYPE_CHECKING:
    from hearth.events.models import MemberAdded
    from hearth.services.common.config import HearthSettings
    from hearth.trust.community import Community
    from hearth.trust.keys import MemberKey


def addition_event(member: Member, stream: str, steward_key: MemberKey) -> MemberAdded:
    """The signed event that adds `member` on `stream`, as the roster holds it."""
    from hearth.events.models import MemberAdded
    from hearth.events.signing import sign_event

    event = MemberAdded(node_id=SYSTEM_MEMBER, member=member.name, public_key=member.public_key,
                        role=member.role, trust=member.trust, stream=stream)  # type: ignore[arg-type]
    return sign_event(event, steward_key)  # type: ignore[return-value]


async def publish_addition(member: Member, steward_key: MemberKey, addition_log: RemovalLog,
                           streams: tuple[str, ...] = ALL_STREAMS) -> PublishedRemoval:
    """Put `member`'s addition on every stream that takes it: where each went (`cuts`) and why each other refused
    it (`failures`). StreamsMissing (nothing published) when a stream does not exist."""
    missing = await addition_log.missing(streams)
    if missing:
        raise streams_missing(missing, addition_log.where)
    published = PublishedRemoval()
    for stream in streams:
        await publish_member_change(addition_event(member, stream, steward_key), stream, addition_log, published)
    return published


def publish_community_addition(community: Community, member: Member, nats_url: str | None,
                               settings: HearthSettings) -> PublishedRemoval:
    """Put the addition of `community`'s member `member` on the community's broker (`nats_url`, else [nats] url)
    with the steward's system key; KeyFileError without that key, BrokerUnreachable, StreamsMissing."""
    from hearth.services.common.lifecycle import run_event_loop
    from hearth.trust.keys import KeyFileError

    if not community.system_key_path.is_file():
        raise KeyFileError(f"{community.system_key_path} does not exist: only the steward, with the community's "
                           "system key, publishes an addition")
    update: dict[str, object] = {"url": nats_url or settings.nats.url, "roster_file": community.roster_path}
    if nats_url is None:
        # No broker named: a steward adding its first members usually has none running yet, and the roster alone
        # is the addition then; a short try keeps each `add` from waiting out the full connect timeout.
        update["connect_timeout_s"] = min(settings.nats.connect_timeout_s, unnamed_broker_connect_timeout_s)
    nats = settings.nats.model_copy(update=update)

    async def publish() -> PublishedRemoval:
        async with steward_removal_log(nats, community.system_key_path) as addition_log:
            return await publish_addition(member, community.system_key(), addition_log)

    return run_event_loop(publish())
