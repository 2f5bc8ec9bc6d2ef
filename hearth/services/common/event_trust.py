"""This process's part in signed events and calls: the member key it signs its events with, the verifier its
projections check events with, the one an orchestrator checks calls with (and a shard host opens, both told of the
steward keys the logs name) and the membership it routes by, all found from its [nats] credentials and the community
roster, and the watch that tells it when its clock is too far off the broker's for any of them to be accepted."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hearth.events.broker_clock import BrokerClockWatch
from hearth.events.member_additions import member_named_by_additions
from hearth.events.member_keys import current_key_by_logs
from hearth.events.signing import EventVerifier, RosterFile
from hearth.events.streams import StreamSetup
from hearth.services.common.call_signing import CallVerifier
from hearth.services.common.config import HearthSettings, NatsSettings
from hearth.services.common.identity import IdentityError, default_roster_for, load_identity
from hearth.services.common.kept_steward_keys import STEWARD_KEYS_FILE
from hearth.services.common.logged_steward_keys import StewardKeysFromTheLog
from hearth.trust.keys import MemberKey
from hearth.trust.roster import CALLER_ROLES, Member, Roster

log = logging.getLogger(__name__)


def event_signing_key(nats: NatsSettings) -> MemberKey | None:
    """The key of [nats] creds_file, which signs every event this process emits; None on an open mesh
    (--insecure), where events go out unsigned. IdentityError when the key is not a member's."""
    if nats.creds_file is None:
        return None
    return load_identity(nats.creds_file, nats.roster_file).key


def stream_setup(nats: NatsSettings) -> StreamSetup:
    """On an open broker (--insecure) a process creates the event streams itself; a member waits for the ones the
    steward creates ([nats] streams_wait_s, or as long as it takes with wait_for_broker)."""
    return StreamSetup(create=nats.creds_file is None, wait_s=None if nats.wait_for_broker else nats.streams_wait_s)


def community_roster_file(nats: NatsSettings) -> Path | None:
    """[nats] roster_file, else the roster beside the key (`community/keys/NAME.nk` -> `community/roster.json`);
    None on an open mesh (no key). IdentityError for a key with neither: a process that logs in with a member key is
    on a community mesh, and the checks it runs against the roster must not be skipped for want of one."""
    if nats.roster_file is not None:
        return nats.roster_file
    if nats.creds_file is None:
        return None
    roster_file = default_roster_for(nats.creds_file)
    if roster_file is None:
        raise IdentityError(f"no community roster for the key {nats.creds_file}: signed calls and events are checked "
                            "against it. Put the roster.json of the community beside the key's keys/ folder, or set "
                            "[nats] roster_file (HEARTH_NATS__ROSTER_FILE)")
    return roster_file


def steward_keys_from_the_log(settings: HearthSettings, js: Any, streams: Sequence[str],
                              state_folder: Path | None = None) -> StewardKeysFromTheLog | None:
    """What follows the steward keys `streams`' logs name, for the calls or opens this process checks (started and
    stopped by it), keeping what it learns in `state_folder` (its STEWARD_KEYS_FILE; None: nowhere); None on an open
    mesh, or when the roster does not read (then opens are not told apart at all)."""
    roster_file = community_roster_file(settings.nats)
    if roster_file is None:
        return None
    try:
        verifier = EventVerifier.from_roster_file(roster_file, max_clock_skew_s=settings.events.max_clock_skew_s)
    except Exception:  # said by open_verifier; an orchestrator refuses to start on it in its projector's verifier
        return None
    kept_file = state_folder / STEWARD_KEYS_FILE if state_folder is not None else None
    return StewardKeysFromTheLog(js, verifier, streams, kept_file)


def call_verifier(settings: HearthSettings, steward_keys: StewardKeysFromTheLog | None = None) -> CallVerifier | None:
    """The check an orchestrator runs on every `llm.chat.request`, from the community's roster and the steward keys
    the logs name (`steward_keys`); None on an open mesh (no roster), where calls are answered unsigned."""
    roster_file = community_roster_file(settings.nats)
    if roster_file is None:
        return None
    roster = RosterFile(roster_file)
    return CallVerifier(lambda recheck: roster.current(recheck_now=recheck),
                        max_clock_skew_s=settings.events.max_clock_skew_s,
                        min_caller_trust=settings.orchestrator.min_caller_trust, caller_roles=CALLER_ROLES,
                        **logged_keys(steward_keys))


def logged_keys(steward_keys: StewardKeysFromTheLog | None) -> dict[str, Any]:
    """What a CallVerifier is told of the keys the logs name and retire (nothing without a follower)."""
    if steward_keys is None:
        return {}
    return dict(logged_steward_keys=steward_keys.named, logged_retired_keys=steward_keys.retired_keys,
                logged_member_keys=lambda signer: steward_keys.views().member_keys_bearing_on(signer),
                logged_member_additions=lambda signer: steward_keys.views().additions_bearing_on_signer(signer))


def open_verifier(settings: HearthSettings, steward_keys: StewardKeysFromTheLog | None = None) -> CallVerifier | None:
    """The check a shard host runs on the signature of every `open` (an orchestrator signs it as a client signs a
    call, with no reply subject), to tell whose hops it holds ([shard] max_hops_per_opener), told of the steward keys
    the logs name (`steward_keys`, as call_verifier); None on an open mesh, or
    when the roster does not read (then opens are not told apart, as on an open mesh); IdentityError for a member
    key with no roster at all (community_roster_file)."""
    roster_file = community_roster_file(settings.nats)
    if roster_file is None:
        return None
    try:
        roster = RosterFile(roster_file)
    except Exception as error:  # a host serves without the share rather than not at all
        log.warning("roster %s does not read (%s): opens are not told apart by orchestrator", roster_file, error)
        return None
    return CallVerifier(lambda recheck: roster.current(recheck_now=recheck),
                        max_clock_skew_s=settings.events.max_clock_skew_s, min_caller_trust="member", signed="open",
                        receiver="shard", **logged_keys(steward_keys))


def node_membership(settings: HearthSettings,
                    steward_keys: StewardKeysFromTheLog | None = None) -> Callable[[str], str | None] | None:
    """On a community mesh, what says why a node may not serve shards (its member was removed from the roster or
    never was in it, or the logs `steward_keys` follows retired the key the roster gives it; None: it may), read from
    the roster file as it changes; None on an open mesh. A removed member's adverts stay in the read model until they
    expire, and its heartbeats stored before the removal keep it looking alive for a while: routing must not wait for
    either, nor for the household's roster copy. A key the logs rotated is no reason: its member serves on under the
    new key (logged_key_of). A member the logs added serves before the roster copy names it (logged_member)."""
    roster_file = community_roster_file(settings.nats)
    if roster_file is None:
        return None
    roster = RosterFile(roster_file)

    def why_not_a_member(node_id: str) -> str | None:
        current = roster.current()
        if current.by_name(node_id) is None:  # perhaps added since the file was last looked at
            current = roster.current(recheck_now=True)
        member = current.by_name(node_id) or logged_member(current, node_id, steward_keys)
        if member is not None:
            if steward_keys is not None and logged_key_of(member, steward_keys) is None:
                return "its member's key was removed (the event log says so; this roster copy not yet)"
            return None
        if any(gone.member.name == node_id for gone in current.removed):
            return "its member was removed from the community"
        return "not a member of the community"

    return why_not_a_member


def logged_member(roster: Roster, name: str, steward_keys: StewardKeysFromTheLog | None) -> Member | None:
    """Member `name` as the logs `steward_keys` follows added it, where the roster copy does not name it yet."""
    if steward_keys is None:
        return None
    return member_named_by_additions(roster, name, steward_keys.views().additions_bearing_on_member(name))


def logged_key_of(member: Member, steward_keys: StewardKeysFromTheLog | None) -> str | None:
    """The key `member` (as the roster gives it) signs and is sealed to by the logs `steward_keys` follows: the end of
    the chain of its rotations there (the roster's key where they show none); None when the logs removed it, or name
    two successors of one key (fail closed until a roster settles it)."""
    if steward_keys is None:
        return member.public_key
    views = steward_keys.views()
    current, _ = current_key_by_logs(member, views.member_keys_of(member.name))
    return None if current is None or current in views.retired else current


def member_public_keys(settings: HearthSettings,
                       steward_keys: StewardKeysFromTheLog | None = None) -> Callable[[str], str | None] | None:
    """On a community mesh, a member's public key by its name (a node's member: what an orchestrator seals an open's
    keys to, hearth/services/transport/key_seal.py), read from the roster file as it changes and followed through the
    rotations the logs `steward_keys` follows show (logged_key_of), a member they added too; None on an open mesh."""
    roster_file = community_roster_file(settings.nats)
    if roster_file is None:
        return None
    roster = RosterFile(roster_file)

    def public_key_of(name: str) -> str | None:
        member = roster.current().by_name(name) or roster.current(recheck_now=True).by_name(name) or \
            logged_member(roster.current(), name, steward_keys)
        return logged_key_of(member, steward_keys) if member is not None else None

    return public_key_of


def event_verifier(settings: HearthSettings, roster_file: Path | None = None) -> EventVerifier | None:
    """The check a projection runs on every event, from `roster_file` or the community's roster; None without
    a roster (an open mesh), where every event is applied as it comes."""
    roster_file = roster_file or community_roster_file(settings.nats)
    if roster_file is None:
        return None
    return EventVerifier.from_roster_file(roster_file, max_clock_skew_s=settings.events.max_clock_skew_s)


def broker_clock_watch(nc: Any, settings: HearthSettings, stream: str, member: str,
                       consequence: str) -> BrokerClockWatch | None:
    """On a community mesh, what measures this process's clock against the broker's (reading `stream`'s info) and
    says, as `member`, when it is beyond [events] max_clock_skew_s and what that does (`consequence`); None on an
    open mesh, where no time is checked."""
    if community_roster_file(settings.nats) is None:
        return None
    return BrokerClockWatch(nc, stream, member=member, max_clock_skew_s=settings.events.max_clock_skew_s,
                            consequence=consequence)
