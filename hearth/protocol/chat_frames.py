"""The frames an orchestrator streams back for an `llm.chat.request` (docs/protocol.md), and decoding them."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from hearth.protocol.bounded_values import (
    Count, CutHops, CutId, CutLabel, CutShardId, Logprob, Measure, Place, Reason, absent_unless_fits, clamped, cut_list,
    read_measure,
)
from hearth.protocol.bounds import max_id_chars, max_label_chars, max_retry_after_s
from hearth.protocol.chat import BadRequest, is_none, max_choices, max_top_logprobs
from hearth.protocol.refusals import RefusalReason, max_param_chars

ErrorCode = Literal[
    "experimental_disabled", "shard_unavailable", "pipeline_stalled", "weights_mismatch", "bad_request",
    "internal_error", "overloaded", "orchestrator_gone", "unauthorized",
]
# Whether a call was held to the verification its ChatParams.verify asked for.
VerificationOutcome = Literal["met", "unmet"]
# Keys of a done frame's `timing` besides those Timing names that a reader keeps.
max_timing_extras = 16


def _is_first_choice(value: object) -> bool:
    return value == 0


class _Frame(BaseModel):
    model_config = ConfigDict(extra="ignore")

    seq: int = Field(ge=0)


class PipelineFrame(_Frame):
    type: Literal["pipeline"] = "pipeline"
    pipeline_id: CutId
    hops: CutHops
    # Which of the request's `n` choices this frame is about (left out for the first).
    choice: int = Field(default=0, ge=0, lt=max_choices, exclude_if=_is_first_choice)


class TokenAlternative(BaseModel):
    """A token and its log-probability at one step (`text`: the token decoded alone)."""

    token_id: int
    text: str
    logprob: Logprob


class TokenLogprobs(BaseModel):
    """The sampled token's log-probability and the best alternatives at its step, most likely first (sent when the
    request asked for `logprobs`). Log-probabilities are those of the logits after `logit_bias` and the penalties,
    before temperature, top-k and top-p; a token the logits rule out entirely (-infinity) is reported as -9999.0, as
    OpenAI does."""

    # The sampled token decoded alone (the frame's `text` is what the stop rules released with it).
    text: str
    logprob: Logprob
    top_logprobs: Annotated[list[TokenAlternative], BeforeValidator(cut_list(max_top_logprobs))] = Field(
        default_factory=list, max_length=max_top_logprobs)


class TokenDeltaFrame(_Frame):
    type: Literal["token_delta"] = "token_delta"
    text: str
    token_id: int
    # Which shard hosts ran the step that produced this token (shard ids, in hop order).
    hops: CutHops | None = None
    # Only when the request asked for `logprobs`; absent otherwise.
    logprobs: TokenLogprobs | None = Field(default=None, exclude_if=is_none)
    # Which of the request's `n` choices this frame is about (left out for the first).
    choice: int = Field(default=0, ge=0, lt=max_choices, exclude_if=_is_first_choice)


class ShardStatusFrame(_Frame):
    type: Literal["shard_status"] = "shard_status"
    shard_id: CutShardId
    status: Literal["degraded", "healthy"]
    reason: Reason
    # Which of the request's `n` choices this frame is about (left out for the first).
    choice: int = Field(default=0, ge=0, lt=max_choices, exclude_if=_is_first_choice)


class ShardFailoverFrame(_Frame):
    type: Literal["shard_failover"] = "shard_failover"
    failed_shard_id: CutShardId
    replacement_hops: CutHops
    resumed_at_token: Count
    # Which of the request's `n` choices this frame is about (left out for the first).
    choice: int = Field(default=0, ge=0, lt=max_choices, exclude_if=_is_first_choice)


# tokens_withdrawn frames one choice may get: an orchestrator withdraws at most once per refuted step, and ends a choice
# (pipeline_aborted, shard_unavailable) whose work is refuted once more, so a client that reprints the kept text after
# each (`hearth chat`) prints a bounded answer; one more is the frame of a hostile or broken orchestrator.
max_withdrawals_per_choice = 16


class TokensWithdrawnFrame(_Frame):
    """A check refuted a shard's output at a step the answer already used: the answer is the first `kept_tokens`
    token_delta frames sent, those after them are withdrawn, and the text goes on after the kept ones (a
    shard_failover frame follows)."""

    type: Literal["tokens_withdrawn"] = "tokens_withdrawn"
    kept_tokens: Count
    shard_id: CutShardId
    reason: Reason
    # Which of the request's `n` choices this frame is about (left out for the first).
    choice: int = Field(default=0, ge=0, lt=max_choices, exclude_if=_is_first_choice)


class PipelineAbortedFrame(_Frame):
    type: Literal["pipeline_aborted"] = "pipeline_aborted"
    code: ErrorCode
    reason: Reason
    # Which of the request's `n` choices this frame is about (left out for the first).
    choice: int = Field(default=0, ge=0, lt=max_choices, exclude_if=_is_first_choice)


class Usage(BaseModel):
    prompt_tokens: Count
    completion_tokens: Count


class Timing(BaseModel):
    """How the call went; more keys may appear (a reader keeps at most 16 of them, `max_timing_extras`, each a number
    or null, read as the fields are)."""

    model_config = ConfigDict(extra="allow")

    ttft_ms: Measure = None
    # How long the call waited in the orchestrator's queue before it started.
    queue_wait_ms: Measure = None
    tokens_per_second: Measure = None
    duration_ms: Measure = None

    @model_validator(mode="before")
    @classmethod
    def _bounded_extras(cls, data: object) -> object:
        """Keys this side does not know are kept only as numbers (or null), at most `max_timing_extras` of them:
        a frame cannot make a reader print or hold text of any size under a name it does not know."""
        if not isinstance(data, dict):
            return data
        known = {key: value for key, value in data.items() if key in cls.model_fields}
        extras = [(key, read_measure(value)) for key, value in data.items()
                  if key not in cls.model_fields and isinstance(key, str) and len(key) <= max_label_chars
                  and (value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)))]
        return {**known, **dict(extras[:max_timing_extras])}


class ChoiceEnd(BaseModel):
    """How one of a request's `n` choices ended."""

    choice: int = Field(ge=0, lt=max_choices)
    finish_reason: CutLabel
    completion_tokens: Count


class DoneFrame(_Frame):
    """The call's last frame when it ended well. With `n` > 1 it ends every choice: `finish_reason` and `timing` are
    the first choice's, `usage.completion_tokens` counts every choice's tokens, and `choices` says how each ended."""

    type: Literal["done"] = "done"
    finish_reason: Literal["stop", "length", "fallback_stop", "fallback_length"] | CutLabel
    usage: Usage
    timing: Timing = Field(default_factory=Timing)
    choices: list[ChoiceEnd] | None = Field(default=None, max_length=max_choices, exclude_if=is_none)
    # The orchestrator that answered (its node id): a conversation's next turn goes to its own subject first.
    orchestrator: Annotated[str | None, BeforeValidator(absent_unless_fits(max_id_chars))] = Field(
        default=None, min_length=1, max_length=max_id_chars, exclude_if=is_none)
    # `unmet`: some hop's work was not checked as `params.verify` asks (no replica to check it, say); absent at `none`.
    verification: VerificationOutcome | None = Field(default=None, exclude_if=is_none)


class KeepaliveFrame(_Frame):
    """Sent when no other frame went out for `[transport] keepalive_interval_s` (a slow step, a failover, a head
    loading): a client that hears nothing at all for `[client] silence_timeout_s` knows the orchestrator is gone."""

    type: Literal["keepalive"] = "keepalive"


class QueuedFrame(_Frame):
    """The call waits for room (the mesh runs as many calls as it can); sent when it joins the queue and again
    whenever its place changes. `position` 1 is the next call to start."""

    type: Literal["queued"] = "queued"
    position: Place
    # Calls waiting on this orchestrator in all (this one included).
    queued_requests: Place


class ErrorFrame(_Frame):
    type: Literal["error"] = "error"
    code: ErrorCode
    message: Reason
    # With `overloaded`: how long the client should wait before sending the call again (at most an hour).
    retry_after_s: float | None = Field(default=None, ge=0, le=max_retry_after_s)
    # With `bad_request`: why, where a client acts on the reason (a program reads this, never the message's words),
    # and the field refused (its top-level name); absent where the refusal has none.
    refusal: RefusalReason | None = Field(default=None, exclude_if=is_none)
    param: Annotated[str | None, BeforeValidator(absent_unless_fits(max_param_chars))] = Field(
        default=None, min_length=1, max_length=max_param_chars, exclude_if=is_none)

    @field_validator("retry_after_s", mode="before")
    @classmethod
    def _wait_within_bounds(cls, value: object) -> object:
        """A longer wait than any client would keep (an infinite one too) reads as the longest, a negative one as
        none, one that is no number (NaN) as absent: the frame still counts, and a client's Retry-After stays a
        number it can send."""
        try:
            wait = value if isinstance(value, bool) else float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return value  # not a number: the field's own check refuses it
        return clamped(0.0, max_retry_after_s)(wait)

    @field_validator("refusal", mode="before")
    @classmethod
    def _unknown_refusal_is_none(cls, value: object) -> object:
        """A reason a newer orchestrator names and this side does not know reads as none given: the frame (and its
        code and message) still counts, rather than failing to decode."""
        return value if value is None or value in get_args(RefusalReason) else None

    @classmethod
    def refusing(cls, error: BadRequest) -> "ErrorFrame":
        """The `bad_request` frame of `error`, its field and reason carried as they are."""
        return cls(seq=0, code="bad_request", message=str(error), refusal=error.reason, param=error.param)


ChatFrame = Annotated[
    Union[PipelineFrame, TokenDeltaFrame, ShardStatusFrame, ShardFailoverFrame, TokensWithdrawnFrame,
          PipelineAbortedFrame, DoneFrame, ErrorFrame, KeepaliveFrame, QueuedFrame],
    Field(discriminator="type"),
]
_frame_adapter: TypeAdapter[ChatFrame] = TypeAdapter(ChatFrame)
FINAL_FRAME_TYPES = frozenset({"done", "error", "pipeline_aborted"})


def decode_frame(data: bytes | dict[str, Any]) -> ChatFrame:
    if isinstance(data, dict):
        return _frame_adapter.validate_python(data)
    return _frame_adapter.validate_json(data)
