"""Subject names for events, shard control and activations (docs/design.md §3, §6), and the shard_key digest."""

from __future__ import annotations

import hashlib

from events.models import EventEnvelope

EVENTS_PREFIX = "hearth.events"
SHARD_EVENTS_WILDCARD = f"{EVENTS_PREFIX}.shard.>"
PIPELINE_EVENTS_WILDCARD = f"{EVENTS_PREFIX}.pipeline.>"
INTEGRITY_EVENTS_WILDCARD = f"{EVENTS_PREFIX}.integrity.>"
CHAT_REQUEST_SUBJECT = "llm.chat.request"

shard_key_hex_chars = 12


def shard_id_for(model_id: str, layer_lo: int, layer_hi: int, node_id: str) -> str:
    return f"{model_id}:{layer_lo}-{layer_hi}@{node_id}"


def shard_key(shard_id: str) -> str:
    """A short, stable, subject-safe digest of a shard_id (model ids carry dots and slashes)."""
    return hashlib.sha256(shard_id.encode()).hexdigest()[:shard_key_hex_chars]


def event_subject(event: EventEnvelope) -> str:
    """Where an event is published: shard events by shard_key, pipeline/integrity events by pipeline_id."""
    family, kind = event.type.split(".", 1)  # type: ignore[attr-defined]
    if family == "shard":
        return f"{EVENTS_PREFIX}.shard.{shard_key(event.shard_id)}.{kind}"  # type: ignore[attr-defined]
    if family in ("pipeline", "integrity"):
        return f"{EVENTS_PREFIX}.{family}.{event.pipeline_id}.{kind}"  # type: ignore[attr-defined]
    raise ValueError(f"no subject for event type {event.type!r}")  # type: ignore[attr-defined]


def shard_control_subject(node_id: str, shard_id: str) -> str:
    return f"hearth.ctl.{_token(node_id)}.{shard_key(shard_id)}"


def activation_subject(pipeline_id: str, hop: int) -> str:
    return f"hearth.act.{pipeline_id}.{hop}"


def ack_subject(pipeline_id: str, hop: int) -> str:
    return f"hearth.ack.{pipeline_id}.{hop}"


def all_acks_subject(pipeline_id: str) -> str:
    return f"hearth.ack.{pipeline_id}.*"


def _token(text: str) -> str:
    """Make free text (a node id) usable as one subject token."""
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in text)
    return safe or "_"
