"""Every NATS subject hearth uses (docs/design.md §3, §6): calls, events, shard control, activations and acks, hop
notices and keepalives; the shard_id, and the shard_key digest and node token that go into them."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Protocol

from hearth.protocol.quantization_labels import is_quantization_label

# Where clients call the orchestrators (a queue group answers) and ask which models the mesh serves.
CHAT_REQUEST_SUBJECT = "llm.chat.request"
MODELS_REQUEST_SUBJECT = "llm.models"
# Every orchestrator's own subject (orchestrator_request_subject), where a conversation's next turn goes to the
# orchestrator whose member's hops keep its history; any caller may send there.
ORCHESTRATOR_REQUEST_WILDCARD = f"{CHAT_REQUEST_SUBJECT}.*"

# Replies go to inboxes under this root, each member's under its own token (inbox_prefix).
INBOX_ROOT = "_INBOX"
EVENTS_PREFIX = "hearth.events"
SHARD_EVENTS_WILDCARD = f"{EVENTS_PREFIX}.shard.>"
PIPELINE_EVENTS_WILDCARD = f"{EVENTS_PREFIX}.pipeline.>"
INTEGRITY_EVENTS_WILDCARD = f"{EVENTS_PREFIX}.integrity.>"

shard_key_hex_chars = 12


def shard_id_for(model_id: str, layer_lo: int, layer_hi: int, node_id: str, *, quantization: str = "none") -> str:
    """`<model_id>:<lo>-<hi>@<node_id>`, with `+<scheme>` after the layers when the weights are quantized: one node
    may serve one range in two schemes, and those are two shards (their own subjects and read-model rows), while an
    unquantized shard keeps the id it had before schemes were part of it."""
    scheme = "" if quantization == "none" else f"+{quantization}"
    return f"{model_id}:{layer_lo}-{layer_hi}{scheme}@{node_id}"


@dataclass(frozen=True)
class ShardIdParts:
    """What a shard_id names (shard_id_for's arguments)."""

    model_id: str
    layer_lo: int
    layer_hi: int
    quantization: str
    node_id: str


# Read from the right: model ids carry colons (`ollama:gemma3:4b`) and slashes, a scheme's label a slash.
_SHARD_ID_RE = re.compile(r"^(?P<model>.+):(?P<lo>\d+)-(?P<hi>\d+)(?:\+(?P<scheme>[^@]+))?@(?P<node>.+)$")


def parse_shard_id(shard_id: str) -> ShardIdParts | None:
    """The parts of a shard_id made by shard_id_for; None when it is not one."""
    match = _SHARD_ID_RE.fullmatch(shard_id)
    if match is None or (match["scheme"] is not None and not is_quantization_label(match["scheme"])):
        return None
    return ShardIdParts(match["model"], int(match["lo"]), int(match["hi"]), match["scheme"] or "none",
                        match["node"])


def node_of_shard(shard_id: str) -> str | None:
    """The node a shard id names (after its last `@`), or None when it names none: what a reputation row and a
    quarantine hold, read from any id that names a node, since an id from an old or foreign host may not parse."""
    _, at_sign, node = shard_id.rpartition("@")
    return node if at_sign and node else None


def shard_key(shard_id: str) -> str:
    """A short, stable, subject-safe digest of a shard_id (model ids carry dots and slashes)."""
    return hashlib.sha256(shard_id.encode()).hexdigest()[:shard_key_hex_chars]


class _EventAddress(Protocol):
    """What an event's subject is made of (hearth/events/models.py: every event type has `type` and `node_id`, shard
    events a `shard_id`, pipeline and integrity events a `pipeline_id`)."""

    type: str
    node_id: str


def event_subject(event: _EventAddress) -> str:
    """Where an event is published: shard events by shard_key, pipeline/integrity events by pipeline_id."""
    family, kind = event.type.split(".", 1)
    if family == "shard":
        # The emitting node leads, so a broker permission can say "a shard host publishes only its own events".
        return (f"{EVENTS_PREFIX}.shard.{node_token(event.node_id)}."
                f"{shard_key(event.shard_id)}.{kind}")
    if family in ("pipeline", "integrity"):
        return f"{EVENTS_PREFIX}.{family}.{event.pipeline_id}.{kind}"
    raise ValueError(f"no subject for event type {event.type!r}")


def event_type_filter(event_type: str) -> str:
    """The subject filter that selects every event of one type, e.g. `shard.heartbeat` (any node, any shard)."""
    family, kind = event_type.split(".", 1)
    wildcards = "*.*" if family == "shard" else "*"  # shard events: node and shard_key; others: pipeline_id
    return f"{EVENTS_PREFIX}.{family}.{wildcards}.{kind}"


def shard_events_filter(shard_key_hex: str) -> str:
    """Every event of one shard, whichever node published it."""
    return f"{EVENTS_PREFIX}.shard.*.{shard_key_hex}.>"


def shard_events_subject_of_node(node_id: str) -> str:
    """Every shard event a node may publish (its broker permission)."""
    return f"{EVENTS_PREFIX}.shard.{node_token(node_id)}.>"


def shard_control_subject(node_id: str, shard_id: str) -> str:
    return f"hearth.ctl.{node_token(node_id)}.{shard_key(shard_id)}"


# Processes that talk to each other without a community (transport tests, benches) share this node token.
LOCAL_NODE = "local"


@dataclass(frozen=True)
class LinkNodes:
    """The two ends of the activation link into one hop: the node that sends the hop its input (the previous
    hop's host, or the orchestrator for hop 0) and the node that receives it (the hop's host, or the
    orchestrator for the sink). Each end's subject carries its own node, so a broker permission lets a host
    subscribe only to the activations sent to it and the acks sent back to it."""

    sender: str = LOCAL_NODE
    receiver: str = LOCAL_NODE


def activation_subject(pipeline_id: str, hop: int, nodes: LinkNodes = LinkNodes()) -> str:
    return f"hearth.act.{node_token(nodes.receiver)}.{pipeline_id}.{hop}"


def ack_subject(pipeline_id: str, hop: int, nodes: LinkNodes = LinkNodes()) -> str:
    return f"hearth.ack.{node_token(nodes.sender)}.{pipeline_id}.{hop}"


def all_acks_subject(pipeline_id: str) -> str:
    """Every hop's acks of one pipeline, whoever sent into the hop (the orchestrator watches them for stalls)."""
    return f"hearth.ack.*.{pipeline_id}.*"


def node_token(text: str) -> str:
    """Make free text (a node id) usable as one subject token."""
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in text)
    return safe or "_"


def orchestrator_request_subject(node_id: str) -> str:
    """Where one orchestrator (its node id, on a community mesh its member name) answers calls besides the queue
    group's subject: the `orchestrator` a done frame names, made one subject token whatever text it is."""
    return f"{CHAT_REQUEST_SUBJECT}.{node_token(node_id)}"


def hop_notice_subject(pipeline_id: str) -> str:
    """Where a pipeline's hops tell its orchestrator at once that a step will not come out of them."""
    return f"hearth.notice.{pipeline_id}"


def keepalive_subject(pipeline_id: str) -> str:
    """Where a pipeline's orchestrator says it is still alive (empty payload, every keepalive_interval_s): a
    shard drops a hop that heard neither a step nor a keepalive for orphan_timeout_s."""
    return f"hearth.keepalive.{pipeline_id}"


def inbox_prefix(member_name: str) -> str:
    """The member's own reply-subject prefix (nats-py's `inbox_prefix`): `_INBOX.<name>`."""
    return f"{INBOX_ROOT}.{node_token(member_name)}"
