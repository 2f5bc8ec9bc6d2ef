"""Renders nats-server's `authorization` block from the community roster: one nkey user per member, with the
subjects its role may publish and subscribe to, so the broker itself refuses what a member may not do.

Subjects carry the node they belong to (hearth/protocol/subjects.py), which lets a permission say "only your own":
a shard host publishes only its own shard events and subscribes only to its own control, activation and ack
subjects and its own inbox. A shard's replies to control requests go into the inboxes of the members that ask
shards (orchestrators, `system`) and its own, named from the roster; orchestrators stream frames into the inboxes of
the members that may call them (clients, `system`). No role but `system` has `allow_responses`: a member that hears
a subject it may also publish on (a host's own control and activation subjects) could name any reply there, hear
its own message and so be granted a publish to that reply (an event, another inbox, JetStream's administration).

JetStream's API is granted verb by verb: a member reads a stream only through ephemeral consumers of its own
(STREAM.INFO, CONSUMER.CREATE/DELETE, flow-control replies: what events.ordered_reader does), and only the
streams its role needs. Creating, updating, deleting, purging or sealing a stream, deleting messages and
every other verb belong to the `system` member alone (the steward's own key, made by `hearth community init`,
which also creates the streams: hearth/events/streams.py), which is also the only one that may subscribe to `>`.

The orchestrators' record of signed calls' nonces (hearth/services/common/call_nonces.py, a key-value bucket): only
orchestrators write it (call_nonces_recording: publish into the bucket and look its stream up), nobody reads it
through the API, and only `system` administers it.

The community's weights (hearth/services/weights_store.py, the object store WEIGHTS_BUCKET): shard hosts and
orchestrators read them (weights_store_reading); only `system` writes them (`hearth weights publish` and `remove` with
the steward's key) and bounds the bucket (hearth/services/broker/weights_bucket.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hearth.events.streams import ALL_STREAMS, SHARDS_STREAM
from hearth.services.common.call_nonces import CALL_NONCES_STREAM, CALL_NONCES_SUBJECTS
from hearth.protocol.subjects import (
    INTEGRITY_EVENTS_WILDCARD,
    PIPELINE_EVENTS_WILDCARD,
    node_token,
    shard_events_subject_of_node,
)
from hearth.protocol.subjects import (
    CHAT_REQUEST_SUBJECT,
    INBOX_ROOT,
    MODELS_REQUEST_SUBJECT,
    ORCHESTRATOR_REQUEST_WILDCARD,
    inbox_prefix,
    orchestrator_request_subject,
)
from hearth.trust.roster import CALLER_ROLES, Member, Role, Roster, TrustLevel, trust_at_least

JS_API = "$JS.API"
# Roles that receive activations (from which a prompt can be recovered): only members at this trust or above.
DEFAULT_MIN_ACTIVATION_TRUST: TrustLevel = "trusted"
# The object store of the community's checkpoints (hearth/services/weights_store.py), and its stream as JetStream names
# it.
WEIGHTS_BUCKET = "hearth-weights"
WEIGHTS_STREAM = f"OBJ_{WEIGHTS_BUCKET}"
# Roles whose members send shards control requests and hear the answers in their inboxes.
SHARD_ASKER_ROLES: tuple[Role, ...] = ("orchestrator", "system")


def is_member_inbox(reply: str) -> bool:
    """Whether `reply` has the form of some member's inbox, `_INBOX.<token>.<...>` (no wildcard)."""
    tokens = reply.split(".")
    return len(tokens) >= 3 and tokens[0] == INBOX_ROOT and _plain_subject(reply)


def reply_allowed(reply: str, role_of: Callable[[str], Role | None] | None = None) -> bool:
    """Whether a service may answer a request on `reply`: on a community mesh (`role_of` gives a member's role
    by name) only into the inbox of a member who may call (`_INBOX.<member>.<...>`, a client or `system`), on an
    open one into an inbox. Never into an event, control or JetStream API subject, nor another role's inbox,
    where an answer would act with the service's rights. Not only the signer's own inbox: the gateway signs with
    the key of the member an API key belongs to and hears the answer on its own."""
    if role_of is None:
        return reply.startswith(f"{INBOX_ROOT}.") and _plain_subject(reply)
    return is_member_inbox(reply) and role_of(reply.split(".")[1]) in CALLER_ROLES


def _plain_subject(subject: str) -> bool:
    tokens = subject.split(".")
    return all(tokens) and not any(token in ("*", ">") for token in tokens) and not any(
        character.isspace() for character in subject)


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


def stream_reading(streams: Iterable[str]) -> tuple[str, ...]:
    """Read `streams` through ephemeral ordered consumers of one's own (events.ordered_reader): look a stream
    up, create a consumer on it (named, with or without filter tokens) and delete it, and answer the consumer's flow
    control. Nothing else: no message get or delete, no consumer on another stream. The broker checks the subject,
    not the request's body: what a member's consumer asks for is bounded by the stream's consumer limits
    (events/streams.py) and swept by the steward (broker/consumer_sweep.py)."""
    reads: list[str] = []
    for stream in streams:
        reads += [f"{JS_API}.STREAM.INFO.{stream}", f"{JS_API}.CONSUMER.CREATE.{stream}.*",
                  f"{JS_API}.CONSUMER.CREATE.{stream}.*.>", f"{JS_API}.CONSUMER.DELETE.{stream}.*",
                  f"$JS.FC.{stream}.>"]
    return tuple(reads)


def weights_store_reading() -> tuple[str, ...]:
    """Fetch objects of the weights store: its stream read through ephemeral consumers of one's own (each object's
    chunks) and single-message gets (each object's metadata, nats-py's ObjectStore.get_info); no writes. Plus
    what nats-py's object store asks besides: STREAM.NAMES (to find the stream of the chunks' subject; it answers
    stream names only) and an unnamed consumer (CONSUMER.CREATE.<stream>, its filter in the request's body)."""
    return (*stream_reading((WEIGHTS_STREAM,)), f"{JS_API}.STREAM.MSG.GET.{WEIGHTS_STREAM}",
            f"{JS_API}.CONSUMER.CREATE.{WEIGHTS_STREAM}", f"{JS_API}.STREAM.NAMES")


def call_nonces_recording() -> tuple[str, ...]:
    """Record a call's nonce (a create into the bucket; the ack comes back to one's own inbox) and look the bucket's
    stream up at start (wait_for_streams): no read, no consumer, no administration."""
    return (CALL_NONCES_SUBJECTS, f"{JS_API}.STREAM.INFO.{CALL_NONCES_STREAM}")


def role_permissions(role: Role, name: str, caller_inboxes: Iterable[str] = (),
                     asker_inboxes: Iterable[str] = ()) -> Permissions:
    """What a member of `role` named `name` may publish and subscribe to; `caller_inboxes`: the inbox prefixes
    of the members that may call an orchestrator (its frames go there); `asker_inboxes`: those of the members that
    ask shards over their control subjects (a shard's answers go there)."""
    node = node_token(name)
    own_inbox = f"{inbox_prefix(name)}.>"
    if role == "shard":
        return Permissions(
            # The shards stream only: `hearth host` reads the mesh's coverage to choose its layers; the pipelines
            # stream (who called, which hops) is none of a shard host's business. Its own node's control subjects:
            # a restarted `hearth host` asks which of its node's adverts are still served. Control replies go to
            # the askers' inboxes by name and to its own (hearth/services/shard/server.py answers `_INBOX.` subjects
            # only), not through `allow_responses`, which a host could turn on itself (the module's docstring).
            publish=(shard_events_subject_of_node(name), f"hearth.ctl.{node}.>", "hearth.act.>", "hearth.ack.>",
                     "hearth.notice.>", *stream_reading((SHARDS_STREAM,)), *weights_store_reading(),
                     *(f"{prefix}.>" for prefix in sorted({*asker_inboxes, inbox_prefix(name)}))),
            subscribe=(f"hearth.ctl.{node}.>", f"hearth.act.{node}.>", f"hearth.ack.{node}.>",
                       "hearth.keepalive.>", own_inbox),
        )
    if role == "orchestrator":
        return Permissions(
            # Frames go to the callers' inboxes by name, not through `allow_responses`: nats-server forgets a
            # response permission at every configuration reload (each roster change) and on a reconnect to
            # another node of a cluster, and a streamed answer outlives both. Which caller's inbox a call may
            # use is checked by the orchestrator itself (hearth/services/orchestrator/service.py).
            publish=(PIPELINE_EVENTS_WILDCARD, INTEGRITY_EVENTS_WILDCARD, "hearth.ctl.>", "hearth.act.>",
                     "hearth.ack.>", "hearth.keepalive.>",
                     *(f"{prefix}.>" for prefix in sorted(set(caller_inboxes))), *stream_reading(ALL_STREAMS),
                     *weights_store_reading(), *call_nonces_recording()),
            # Every activation link, not only those into itself: it taps the links between its pipelines' hops to
            # check what each hop computed (hearth/services/orchestrator/recording.py). Another orchestrator's links are
            # sealed under keys it never had, so it learns nothing from them.
            # Of the orchestrators' own subjects only its own: another member's calls to its orchestrator are not
            # ours to hear.
            subscribe=(CHAT_REQUEST_SUBJECT, orchestrator_request_subject(name), MODELS_REQUEST_SUBJECT,
                       "hearth.act.>", "hearth.ack.>", "hearth.notice.>", own_inbox),
        )
    if role in ("projector", "auditor"):
        return Permissions(publish=stream_reading(ALL_STREAMS), subscribe=(own_inbox,))
    if role == "client":
        # Any orchestrator's own subject: a conversation's next turn goes to the one that answered the last.
        return Permissions(publish=(CHAT_REQUEST_SUBJECT, ORCHESTRATOR_REQUEST_WILDCARD, MODELS_REQUEST_SUBJECT),
                           subscribe=(own_inbox,))
    if role == "system":
        return Permissions(publish=(">",), subscribe=(">",), allow_responses=True)
    raise ValueError(f"unknown role {role!r}")


def admitted(member: Member, min_activation_trust: TrustLevel = DEFAULT_MIN_ACTIVATION_TRUST) -> bool:
    """Shard hosts and orchestrators see activations: below `min_activation_trust` they get no user at all."""
    if member.role in ("shard", "orchestrator"):
        return trust_at_least(member.trust, min_activation_trust)
    return True


def caller_inbox_prefixes(roster: Roster) -> tuple[str, ...]:
    """The inbox prefixes of the roster's members that may call an orchestrator."""
    return tuple(inbox_prefix(member.name) for member in roster.members if member.role in CALLER_ROLES)


def shard_asker_inbox_prefixes(roster: Roster) -> tuple[str, ...]:
    """The inbox prefixes of the roster's members that ask shards over their control subjects (orchestrators open
    and probe hops; `system` may publish anywhere)."""
    return tuple(inbox_prefix(member.name) for member in roster.members if member.role in SHARD_ASKER_ROLES)


def authorization_users(roster: Roster, *,
                        min_activation_trust: TrustLevel = DEFAULT_MIN_ACTIVATION_TRUST) -> list[dict]:
    callers, askers = caller_inbox_prefixes(roster), shard_asker_inbox_prefixes(roster)
    return [{"nkey": member.public_key,
             "permissions": role_permissions(member.role, member.name, callers, askers).render()}
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
