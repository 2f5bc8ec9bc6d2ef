"""The event vocabulary of docs/events.md: one pydantic model per event type, in one discriminated union."""

from __future__ import annotations

import re
import uuid
from datetime import datetime, timezone
from typing import Annotated, Any, Callable, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

# Subject tokens may not carry dots, spaces or wildcards; pipeline ids become subject tokens.
SUBJECT_TOKEN_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"
_subject_token_re = re.compile(SUBJECT_TOKEN_PATTERN)


def new_event_id() -> str:
    return uuid.uuid4().hex


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


class EventEnvelope(BaseModel):
    """Fields every event carries; `event_id` doubles as the Nats-Msg-Id header for de-duplication."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    event_id: str = Field(default_factory=new_event_id, min_length=1, max_length=64)
    version: int = 1
    occurred_at: datetime = Field(default_factory=utc_now)
    node_id: str = Field(min_length=1, max_length=256)

    @field_validator("occurred_at")
    @classmethod
    def _aware_utc(cls, value: datetime) -> datetime:
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)

    @property
    def kind(self) -> str:
        """The part of `type` after the family, e.g. `advertised` for `shard.advertised`."""
        return self.type.split(".", 1)[1]  # type: ignore[attr-defined]


class _PipelineEvent(EventEnvelope):
    pipeline_id: str

    @field_validator("pipeline_id")
    @classmethod
    def _subject_safe(cls, value: str) -> str:
        if not _subject_token_re.match(value):
            raise ValueError(f"pipeline_id {value!r} must match {SUBJECT_TOKEN_PATTERN}")
        return value


class ShardAdvertised(EventEnvelope):
    type: Literal["shard.advertised"] = "shard.advertised"
    shard_id: str
    model_id: str
    weights_sha256: str
    layer_lo: int = Field(ge=0)
    layer_hi: int = Field(ge=0, description="inclusive")
    total_layers: int = Field(ge=1)
    dtype: str
    memory_required_mb: float = Field(ge=0)
    max_concurrent_streams: int = Field(ge=1)
    control_subject: str
    hop_weight: float = Field(default=1.0, gt=0)
    ttl_s: float = Field(gt=0)


class ShardHeartbeat(EventEnvelope):
    type: Literal["shard.heartbeat"] = "shard.heartbeat"
    shard_id: str
    queue_depth: int = Field(ge=0)
    active_streams: int = Field(ge=0)
    p95_latency_ms: float = Field(ge=0)
    tokens_served_total: int = Field(ge=0)


class ShardWithdrawn(EventEnvelope):
    type: Literal["shard.withdrawn"] = "shard.withdrawn"
    shard_id: str
    reason: str


class PipelineConstructed(_PipelineEvent):
    type: Literal["pipeline.constructed"] = "pipeline.constructed"
    request_id: str
    model_id: str
    weights_sha256: str
    hops: list[str]
    construct_ms: float = Field(ge=0)


class PipelineFirstToken(_PipelineEvent):
    type: Literal["pipeline.first_token"] = "pipeline.first_token"
    ttft_ms: float = Field(ge=0)


class PipelineShardStatus(_PipelineEvent):
    type: Literal["pipeline.shard_status"] = "pipeline.shard_status"
    shard_id: str
    status: Literal["degraded", "healthy"]
    reason: str


class PipelineFailover(_PipelineEvent):
    type: Literal["pipeline.failover"] = "pipeline.failover"
    failed_shard_id: str
    replacement_hops: list[str]
    reason: str
    resumed_at_token: int = Field(ge=0)


class PipelineFallbackLocal(_PipelineEvent):
    type: Literal["pipeline.fallback_local"] = "pipeline.fallback_local"
    reason: str


class PipelineCompleted(_PipelineEvent):
    type: Literal["pipeline.completed"] = "pipeline.completed"
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    duration_ms: float = Field(ge=0)
    tokens_per_second: float = Field(ge=0)
    finish_reason: str


class PipelineAborted(_PipelineEvent):
    type: Literal["pipeline.aborted"] = "pipeline.aborted"
    code: str
    reason: str


class IntegrityCorruptionDetected(_PipelineEvent):
    type: Literal["integrity.corruption_detected"] = "integrity.corruption_detected"
    shard_id: str
    check: Literal["nan", "inf", "norm"]


EVENT_CLASSES: tuple[type[EventEnvelope], ...] = (
    ShardAdvertised,
    ShardHeartbeat,
    ShardWithdrawn,
    PipelineConstructed,
    PipelineFirstToken,
    PipelineShardStatus,
    PipelineFailover,
    PipelineFallbackLocal,
    PipelineCompleted,
    PipelineAborted,
    IntegrityCorruptionDetected,
)
Event = Annotated[Union[EVENT_CLASSES], Field(discriminator="type")]  # type: ignore[valid-type]
EVENT_TYPES: dict[str, type[EventEnvelope]] = {model.model_fields["type"].default: model for model in EVENT_CLASSES}

_event_adapter: TypeAdapter[Event] = TypeAdapter(Event)

# (type, stored version) -> function turning that version's JSON dict into the next version's.
# A breaking change to an event is a new version plus an upcaster here; old log entries stay readable.
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
UPCASTERS: dict[tuple[str, int], Upcaster] = {}


def upcast(raw: dict[str, Any]) -> dict[str, Any]:
    while (upcaster := UPCASTERS.get((raw.get("type"), raw.get("version", 1)))) is not None:
        raw = upcaster(raw)
    return raw


def decode_event(data: bytes | str | dict[str, Any]) -> Event:
    """Parse one stored event (JSON bytes or a dict); raises pydantic.ValidationError or ValueError."""
    if isinstance(data, dict):
        return _event_adapter.validate_python(upcast(dict(data)))
    return _event_adapter.validate_python(upcast(_load_json_object(data)))


def encode_event(event: EventEnvelope) -> bytes:
    return event.model_dump_json().encode()


def _load_json_object(data: bytes | str) -> dict[str, Any]:
    import json

    value = json.loads(data)
    if not isinstance(value, dict):
        raise ValueError(f"an event is a JSON object, got {type(value).__name__}")
    return value
