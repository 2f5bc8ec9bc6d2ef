"""Renders nats-server's `authorization` block from the community roster: one nkey user per member, with the
subjects its role may publish and subscribe to, so the broker itself refuses what a member may not do.

Subjects carry the node they belong to (events/subjects.py), which lets a permission say "only your own":
a shard host publishes only its own shard events and subscribes only to its own control, activation and ack
subjects and its own inbox. Replies to requests (a shard answering `open`) go out under `allow_responses`,
so no member may publish into another's inbox except orchestrators, which stream frames to callers. Nobody
in the roster but the `system` member (the steward's own key, made by `hearth community init`; the demo and
the tests watch everything with it) may subscribe to `>`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from events.streams import ALL_STREAMS, SHARDS_STREAM
from events.subjects import (
    INTEGRITY_EVENTS_WILDCARD,
    PIPELINE_EVENTS_WILDCARD,
    node_token,
    shard_events_subject_of_node,
)
from services.common.chat_protocol import CHAT_REQUEST_SUBJECT, MODELS_REQUEST_SUBJECT
from trust.roster import Member, Role, Roster, TrustLevel, trust_at_least

INBOX_ROOT = "_INBOX"
JS_API = "$JS.API"
# Roles that receive activations (from which a prompt can be recovered): only members at this trust or above.
DEFAULT_MIN_ACTIVATION_TRUST: TrustLevel = "trusted"


def inbox_prefix(member_name: str) -> str:
    """The member's own reply-subject prefix (nats-py's `inbox_prefix`): `_INBOX.<name>`."""
    return f"{INBOX_ROOT}.{node_token(member_name)}"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False

    def render(self) -> dict:
        block: dict = {"publish": {"allow": list(self.publish)}, "subscribe": {"allow": list(self.subscribe)}}
        if self.allow_responses:
            block["allow_responses"] = True
        return block


def _stream_management() -> tuple[str, ...]:
    """Create, update and inspect hearth's two streams (ensure_streams at start), nothing else."""
    return tuple(f"{JS_API}.STREAM.{verb}.{stream}" for stream in ALL_STREAMS for verb in ("CREATE", "UPDATE", "INFO"))


def _stream_reading(streams: tuple[str, ...] = ALL_STREAMS) -> tuple[str, ...]:
    """Read `streams` through consumers of one's own (projectors, routing, hearth-replay)."""
    reads = []
    for stream in streams:
        reads += [f"{JS_API}.STREAM.INFO.{stream}", f"{JS_API}.CONSUMER.CREATE.{stream}",
                  f"{JS_API}.CONSUMER.CREATE.{stream}.>", f"{JS_API}.CONSUMER.DELETE.{stream}.>",
                  f"{JS_API}.CONSUMER.INFO.{stream}.>", f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.>",
                  f"{JS_API}.STREAM.MSG.GET.{stream}", f"{JS_API}.DIRECT.GET.{stream}.>",
                  f"$JS.FC.{stream}.>", f"$JS.ACK.{stream}.>"]
    return (f"{JS_API}.INFO", f"{JS_API}.STREAM.NAMES", f"{JS_API}.STREAM.LIST", *reads)


def role_permissions(role: Role, name: str) -> Permissions:
    """What a member of `role` named `name` may publish and subscribe to."""
    node = node_token(name)
    own_inbox = f"{inbox_prefix(name)}.>"
    if role == "shard":
        return Permissions(
            # The shards stream only: `hearth host` reads the mesh's coverage to choose its layers; the pipelines
            # stream (who called, which hops) is none of a shard host's business.
            publish=(shard_events_subject_of_node(name), "hearth.act.>", "hearth.ack.>", "hearth.notice.>",
                     *_stream_management(), *_stream_reading((SHARDS_STREAM,))),
            subscribe=(f"hearth.ctl.{node}.>", f"hearth.act.{node}.>", f"hearth.ack.{node}.>",
                       "hearth.keepalive.>", own_inbox),
            allow_responses=True,
        )
    if role == "orchestrator":
        return Permissions(
            publish=(PIPELINE_EVENTS_WILDCARD, INTEGRITY_EVENTS_WILDCARD, "hearth.ctl.>", "hearth.act.>",
                     "hearth.ack.>", "hearth.keepalive.>", f"{INBOX_ROOT}.>", *_stream_management(),
                     *_stream_reading()),
            subscribe=(CHAT_REQUEST_SUBJECT, MODELS_REQUEST_SUBJECT, f"hearth.act.{node}.>", "hearth.ack.>",
                       "hearth.notice.>", own_inbox),
            allow_responses=True,
        )
    if role == "projector":
        return Permissions(publish=(*_stream_management(), *_stream_reading()), subscribe=(own_inbox,))
    if role == "auditor":
        return Permissions(publish=_stream_reading(), subscribe=(own_inbox,))
    if role == "client":
        return Permissions(publish=(CHAT_REQUEST_SUBJECT, MODELS_REQUEST_SUBJECT), subscribe=(own_inbox,))
    if role == "system":
        return Permissions(publish=(">",), subscribe=(">",), allow_responses=True)
    raise ValueError(f"unknown role {role!r}")


def admitted(member: Member, min_activation_trust: TrustLevel = DEFAULT_MIN_ACTIVATION_TRUST) -> bool:
    """Shard hosts and orchestrators see activations: below `min_activation_trust` they get no user at all."""
    if member.role in ("shard", "orchestrator"):
        return trust_at_least(member.trust, min_activation_trust)
    return True


def authorization_users(roster: Roster, *,
                        min_activation_trust: TrustLevel = DEFAULT_MIN_ACTIVATION_TRUST) -> list[dict]:
    return [{"nkey": member.public_key, "permissions": role_permissions(member.role, member.name).render()}
            for member in roster.members if admitted(member, min_activation_trust)]


def render_authorization(roster: Roster, *,
                         min_activation_trust: TrustLevel = DEFAULT_MIN_ACTIVATION_TRUST) -> str:
    """The `authorization { users = [...] }` block for nats-server's configuration (JSON is valid there)."""
    users = authorization_users(roster, min_activation_trust=min_activation_trust)
    header = (f"# hearth community {roster.community!r}: {len(users)} users, generated by "
              "`hearth community nats-config` from the roster; regenerate it after every change to the roster.\n")
    return header + "authorization " + json.dumps({"users": users}, indent=2) + "\n"


def refused_members(roster: Roster, min_activation_trust: TrustLevel = DEFAULT_MIN_ACTIVATION_TRUST
                    ) -> Iterable[Member]:
    return (member for member in roster.members if not admitted(member, min_activation_trust))
