"""The event vocabulary of docs/events.md: one pydantic model per event type, in one discriminated union."""

from __future__ import annotations

import re
from typing import Annotated, Any, Callable, Literal, Union

from pydantic import ConfigDict, Field, TypeAdapter, field_validator, model_validator

from hearth.events.envelope import (
    BoundedNumbers,
    EventEnvelope,
    Hops,
    Id,
    Label,
    ShardId,
    max_event_duration_s,
    max_event_hops,
    max_event_number,
)
from hearth.events.newer_hearth import could_be_a_type, newer_hearth_event
from hearth.protocol.bounded_values import Reason
from hearth.protocol.bounds import SUBJECT_TOKEN_PATTERN
from hearth.protocol.mesh_protocol import max_mesh_protocol
from hearth.protocol.chat_frames import VerificationOutcome
from hearth.trust.keys import PUBLIC_KEY_PATTERN, USER_PUBLIC_KEY_LENGTH
from hearth.trust.roster import MEMBER_NAME_PATTERN, ROLES, TrustLevel

_subject_token_re = re.compile(SUBJECT_TOKEN_PATTERN)

# A shard's distance as it advertises it unless told: on the same LAN (docs/design.md §5).
default_hop_weight = 1.0
# The most decoder layers a model an advertisement names may have: far beyond any model, and few enough for routing's
# per-layer walks.
max_model_layers = 4096


class _PipelineEvent(EventEnvelope):
    pipeline_id: str = Field(max_length=128)

    @field_validator("pipeline_id")
    @classmethod
    def _subject_safe(cls, value: str) -> str:
        if not _subject_token_re.match(value):
            raise ValueError(f"pipeline_id {value!r} must match {SUBJECT_TOKEN_PATTERN}")
        return value


class ShardAdvertised(EventEnvelope):
    type: Literal["shard.advertised"] = "shard.advertised"
    shard_id: ShardId
    model_id: Id
    weights_sha256: Id
    layer_lo: int = Field(ge=0)
    layer_hi: int = Field(ge=0, description="inclusive")
    total_layers: int = Field(ge=1)
    dtype: Label
    memory_required_mb: float = Field(ge=0)
    max_concurrent_streams: int = Field(ge=1)
    control_subject: Id
    hop_weight: float = Field(default=default_hop_weight, gt=0)
    ttl_s: float = Field(gt=0, le=max_event_duration_s)
    # Where the shard computes (absent in advertisements from before devices were advertised).
    device_kind: Literal["cpu", "cuda"] | None = None
    device_name: Label | None = None
    kv_cache_budget_mb: float | None = Field(default=None, ge=0)
    # How the weights are quantized ("none", "int8", "int4/g64"): part of the shard's identity, since a pipeline
    # never mixes schemes; advertisements from before quantization read as "none".
    quantization: Label = "none"
    # The mesh protocol the shard speaks (hearth/protocol/mesh_protocol.py); absent from a hearth from before
    # protocol versions, which an orchestrator of another version leaves out of its chains, saying why.
    protocol: int | None = Field(default=None, ge=1, le=max_mesh_protocol)

    @model_validator(mode="after")
    def _layers_inside_the_model(self) -> "ShardAdvertised":
        # A range no model has would divide routing's per-layer costs by zero or walk layers that do not exist.
        if not self.layer_lo <= self.layer_hi < self.total_layers <= max_model_layers:
            raise ValueError(f"layers {self.layer_lo}-{self.layer_hi} of {self.total_layers} are no range of a model "
                             f"(of at most {max_model_layers} layers)")
        return self


class ShardHeartbeat(EventEnvelope):
    type: Literal["shard.heartbeat"] = "shard.heartbeat"
    shard_id: ShardId
    queue_depth: int = Field(ge=0)
    active_streams: int = Field(ge=0)
    p95_latency_ms: float = Field(ge=0)
    tokens_served_total: int = Field(ge=0)
    # Median compute time of a decode step over the shard's whole layer range, measured on its recent steps
    # (routing predicts time per token from it); None before its first decode step, and from older shards.
    decode_step_ms: float | None = Field(default=None, ge=0)


class ShardWithdrawn(EventEnvelope):
    type: Literal["shard.withdrawn"] = "shard.withdrawn"
    shard_id: ShardId
    reason: Reason


class PipelineConstructed(_PipelineEvent):
    type: Literal["pipeline.constructed"] = "pipeline.constructed"
    request_id: Id
    model_id: Id
    weights_sha256: Id
    hops: Hops
    construct_ms: float = Field(ge=0)
    # The roster name of the member whose signed call this is (None on an open mesh).
    caller: Id | None = None
    # Prompt positions every hop already held from calls that began the same way (kept prefixes), not prefilled.
    cached_prompt_tokens: int = Field(default=0, ge=0)


class PipelineFirstToken(_PipelineEvent):
    type: Literal["pipeline.first_token"] = "pipeline.first_token"
    ttft_ms: float = Field(ge=0)


class PipelineShardStatus(_PipelineEvent):
    type: Literal["pipeline.shard_status"] = "pipeline.shard_status"
    shard_id: ShardId
    status: Literal["degraded", "healthy"]
    reason: Reason


class PipelineFailover(_PipelineEvent):
    type: Literal["pipeline.failover"] = "pipeline.failover"
    failed_shard_id: ShardId
    replacement_hops: Hops
    reason: Reason
    resumed_at_token: int = Field(ge=0)


# A failover's `reason` when a hop reported that its input from `failed_shard_id` failed a check: the orchestrator
# cannot verify that, so the shard was routed around for that call only and is blamed nowhere.
UNVERIFIED_REPORT = "reported"


class PipelineFallbackLocal(_PipelineEvent):
    type: Literal["pipeline.fallback_local"] = "pipeline.fallback_local"
    reason: Reason


BlockName = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$", max_length=32)]
# Named blocks one kept prefix records: the last, the last two inside the prompt, and the 1st, 2nd, 4th, ... (the
# most blocks a call names is protocol.control.max_prefix_blocks, 8192 = 2**13).
max_kept_marks = 24


class KeptHop(BoundedNumbers):
    """One hop of a chain that kept a call's blocks: the shard and the layers it ran."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shard_id: ShardId
    layer_lo: int = Field(ge=0)
    layer_hi: int = Field(ge=0, description="inclusive")


class KeptMark(BoundedNumbers):
    """One kept block's mark (a digest of its name, on a community mesh of the orchestrator's member key too: the name
    opens its KV on a shard, the mark only finds the chain keeping it for that member) and how many blocks it closes
    (it stands for those and every one before)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    blocks: int = Field(ge=1)
    name: BlockName


class KeptPrefix(BoundedNumbers):
    """The blocks a call's hops were asked to keep when it ended well (docs/design.md, "Kept prefixes"), so that
    every orchestrator can send a call beginning the same way to them. A block's mark is a digest of its name, itself a
    digest over the scoped tokens of every block up to it: it reveals only that two calls began alike, never a token,
    and cannot be turned back into the name that would open the KV."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hops: list[KeptHop] = Field(min_length=1, max_length=max_event_hops)
    # Some of the kept blocks' names, looked up longest first by a later call: the last, the last two inside the
    # prompt (a next turn resends the prompt as it was, while the answer may tokenize differently there) and the
    # 1st, 2nd, 4th, ... (what a call sharing fewer blocks, an edited history, still finds).
    marks: list[KeptMark] = Field(min_length=1, max_length=max_kept_marks)
    # How long the hops keep blocks nobody uses (the mesh's `[shard] prefix_cache_idle_s` as the orchestrator knows
    # it): the read model forgets the record after that.
    idle_s: float = Field(ge=0, le=max_event_duration_s)


class PipelineCompleted(_PipelineEvent):
    type: Literal["pipeline.completed"] = "pipeline.completed"
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    duration_ms: float = Field(ge=0)
    tokens_per_second: float = Field(ge=0)
    finish_reason: Label
    # The blocks its chain's hops were asked to keep (None: nothing kept: kept prefixes off, or too short a call).
    kept_prefix: KeptPrefix | None = None
    # Whether its hops' work was checked as its `verify` level asks (the done frame's `verification`; None: `none`).
    verification: VerificationOutcome | None = None


class PipelineAborted(_PipelineEvent):
    type: Literal["pipeline.aborted"] = "pipeline.aborted"
    code: Label
    reason: Reason


class IntegrityCorruptionDetected(_PipelineEvent):
    type: Literal["integrity.corruption_detected"] = "integrity.corruption_detected"
    shard_id: ShardId
    # `shape`: a step whose declared shape, dtype or size did not fit the pipeline (refused on arrival).
    check: Literal["nan", "inf", "norm", "shape"]


# How many shards one verification summary may name (a call checked on more sends several summaries).
max_verified_shards = max_event_hops
Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", max_length=64)]
StepKind = Literal["prefill", "decode", "replay"]


class ShardVerification(BoundedNumbers):
    """One shard's work in one call that spot-checks confirmed (hearth/services/orchestrator/verification.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shard_id: ShardId
    # Checks run on its output, and the positions whose output they confirmed (a check covers every position the
    # shard computed since the last one).
    checks: int = Field(ge=0)
    verified_positions: int = Field(ge=0)


class IntegrityShardsVerified(_PipelineEvent):
    """The checks of one call that found nothing wrong, aggregated per shard: one event per call, not per check."""

    type: Literal["integrity.shards_verified"] = "integrity.shards_verified"
    shards: list[ShardVerification] = Field(max_length=max_verified_shards)


class _MismatchEvidence(_PipelineEvent):
    """What a mismatch between two computations of the same layers on the same input was: where, by how much, and
    a digest of the compared bytes (never the activations themselves)."""

    layer_lo: int = Field(ge=0)
    layer_hi: int = Field(ge=0, description="inclusive")
    quantization: Label
    dtype: Label
    # The first position whose outputs differ beyond the tolerance, and the step that computed it on the shard.
    position: int = Field(ge=0)
    step_kind: StepKind
    relative_error: float = Field(ge=0)
    tolerance: float = Field(gt=0)
    # sha256 over the compared input and both outputs as they travelled (wire dtype), position by position.
    evidence_sha256: Sha256Hex


class IntegrityMismatchConfirmed(_MismatchEvidence):
    """`shard_id`'s output disagreed with what two other parties computed and agreed on (`witnesses`: a verifying
    replica and a tie-breaker): the shard is quarantined until a steward clears it."""

    type: Literal["integrity.mismatch_confirmed"] = "integrity.mismatch_confirmed"
    shard_id: ShardId
    witnesses: Hops = Field(min_length=2)


class IntegrityMismatchDisputed(_MismatchEvidence):
    """Two shards computed the same layers on the same input differently and no third party could say which was
    right: the call routed around both, nobody is quarantined, both are counted as disputed."""

    type: Literal["integrity.mismatch_disputed"] = "integrity.mismatch_disputed"
    shard_ids: Hops = Field(min_length=2, max_length=2)


class IntegrityQuarantineCleared(_PipelineEvent):
    """A steward (a `system` member) lets a quarantined shard serve again. `pipeline_id` is the clearing's own id
    (integrity events are addressed by it)."""

    type: Literal["integrity.quarantine_cleared"] = "integrity.quarantine_cleared"
    shard_id: ShardId
    reason: Reason


class MemberChange(EventEnvelope):
    """A steward's change to the community's members that marks a position in one stream's log (`stream`): published
    on that stream's members subject (MEMBER_REMOVAL_SUBJECTS) and read, in stream order, by every process that
    follows the log's removals, rotations and additions."""

    member: str = Field(max_length=63, pattern=MEMBER_NAME_PATTERN)
    public_key: str = Field(max_length=USER_PUBLIC_KEY_LENGTH, pattern=PUBLIC_KEY_PATTERN)
    # The stream whose position this event marks: it counts only there (a copy stored elsewhere is rejected).
    stream: Label


class MemberRemoved(MemberChange):
    """A steward (a `system` member) removed `member` from the community: what `public_key` signed that `stream`
    stores after this event is not applied (hearth/events/signing.py). `hearth community remove` publishes one on
    each stream, so the removal is a position in the log, not a time on the steward's clock."""

    type: Literal["member.removed"] = "member.removed"


class MemberKeyRotated(MemberRemoved):
    """A steward (a `system` member) replaced `member`'s key (`hearth community rotate-key`): `public_key` is the key
    it retired and `new_public_key` the one it holds from now on. To the log it is the removal of the old key alone
    (a MemberRemoved: what that key signed and `stream` stores after this event is not applied), while the member,
    its node and its record stay under the new key."""

    type: Literal["member.key_rotated"] = "member.key_rotated"  # type: ignore[assignment]
    new_public_key: str = Field(max_length=USER_PUBLIC_KEY_LENGTH, pattern=PUBLIC_KEY_PATTERN)


class MemberAdded(MemberChange):
    """A steward (a `system` member) added `member` under `public_key` with `role` and `trust`, as `hearth community
    add` wrote it in the roster: from this event's position in `stream` on, a reader whose roster copy does not name
    the member yet takes it as the roster would (hearth/events/member_additions.py). The roles are those `add` gives
    (never `system`)."""

    type: Literal["member.added"] = "member.added"  # type: ignore[assignment]
    role: Literal[ROLES]  # type: ignore[valid-type]
    trust: TrustLevel


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
    IntegrityShardsVerified,
    IntegrityMismatchConfirmed,
    IntegrityMismatchDisputed,
    IntegrityQuarantineCleared,
    MemberRemoved,
    MemberKeyRotated,
    MemberAdded,
)
Event = Annotated[Union[EVENT_CLASSES], Field(discriminator="type")]  # type: ignore[valid-type]
EVENT_TYPES: dict[str, type[EventEnvelope]] = {model.model_fields["type"].default: model for model in EVENT_CLASSES}
# The latest version of each type this hearth reads (older ones through UPCASTERS).
READABLE_VERSIONS: dict[str, int] = {kind: model.model_fields["version"].default for kind, model in EVENT_TYPES.items()}

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
    """Parse one stored event (JSON bytes or a dict); raises ValueError (pydantic.ValidationError among them) for
    anything that is not one, whatever it holds."""
    try:
        raw = upcast(dict(data) if isinstance(data, dict) else _load_json_object(data))
        _refuse_another_hearths(raw)
        return _event_adapter.validate_python(raw)
    # TypeError: a type or version that is a list or an object (no upcaster is looked up by it); RecursionError: a
    # body nested deeper than the parser goes; OverflowError: a date past the calendar's ends.
    except (TypeError, RecursionError, OverflowError) as error:
        raise ValueError(f"not an event: {type(error).__name__}: {error}") from None


def _refuse_another_hearths(raw: dict[str, Any]) -> None:
    """EventOfANewerHearth (a ValueError), in one line, for an event only a newer hearth reads: a type this one does
    not know, or a version of its type past this one's (a breaking change, which read as this hearth's own version
    would be misread)."""
    kind, version = raw.get("type"), raw.get("version", 1)
    if (not isinstance(kind, str) or not isinstance(version, int) or isinstance(version, bool)
            or abs(version) > max_event_number or not could_be_a_type(kind)):
        return  # malformed: validation says what is wrong with it
    known = READABLE_VERSIONS.get(kind)
    if known is None or version > known:
        raise newer_hearth_event(raw, kind, version, known)


def encode_event(event: EventEnvelope) -> bytes:
    return event.model_dump_json().encode()


def _load_json_object(data: bytes | str) -> dict[str, Any]:
    import json

    value = json.loads(data)
    if not isinstance(value, dict):
        raise ValueError(f"an event is a JSON object, got {type(value).__name__}")
    return value
