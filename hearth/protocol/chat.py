"""The client protocol of docs/protocol.md: the `llm.chat.request` message and the frames streamed back."""

from __future__ import annotations

import sys
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator,
)

from hearth.protocol.bounds import max_id_chars
from hearth.protocol.chat_tools import ResponseFormat, ToolCallList, ToolChoice, ToolList
from hearth.protocol.quantization_labels import QuantizationLabel
from hearth.protocol.refusals import describe_validation_error

max_tokens_limit = 8192
# What a call generates at most when it does not say (hearth/inference/sampling.py mirrors it).
default_max_tokens = 128
max_prompt_chars = 1_000_000
# Turns of one conversation: far beyond any context window's worth, and a bound on a body's validation work.
max_messages = 4096
max_stop_strings = 16
max_stop_chars = 256
# Beyond any vocabulary; a larger value would only ever mean "off" (as 0 does) and overflow torch's int64 arguments.
max_top_k = 2**31 - 1
# OpenAI's bounds for the options that shape the logits and report them.
max_top_logprobs = 20
max_logit_bias_entries = 300
max_logit_bias = 100.0
max_openai_penalty = 2.0
# An extension (transformers' repetition_penalty); its bounds keep every logit it divides or multiplies finite.
min_repetition_penalty = 0.01
max_repetition_penalty = 10.0
# Choices one request may ask for (`n`): each is a pipeline of its own that shares the prompt's prefill.
max_choices = 8


def _not_subnormal(value: float) -> float:
    # A subnormal temperature (1e-320) overflows every logit it divides; such values are never meant.
    if value != 0.0 and abs(value) < sys.float_info.min:
        raise ValueError(f"subnormal numbers (below {sys.float_info.min:.3g} in magnitude) are not accepted")
    return value


def _is_none(value: object) -> bool:
    return value is None


def _is_first_choice(value: object) -> bool:
    return value == 0


# Finite (no NaN, no Infinity) and not subnormal: what a sampling parameter may be.
FiniteFloat = Annotated[float, Field(allow_inf_nan=False), AfterValidator(_not_subnormal)]
StopString = Annotated[str, Field(min_length=1, max_length=max_stop_chars)]
BiasedTokenId = Annotated[int, Field(ge=0, le=max_top_k)]
LogitBias = Annotated[float, Field(allow_inf_nan=False, ge=-max_logit_bias, le=max_logit_bias),
                      AfterValidator(_not_subnormal)]

ErrorCode = Literal[
    "experimental_disabled", "shard_unavailable", "pipeline_stalled", "weights_mismatch", "bad_request",
    "internal_error", "overloaded", "orchestrator_gone", "unauthorized",
]


# How much of the shards' work a call has checked on other replicas (ChatParams.verify), and whether it was held to it.
VerifyLevel = Literal["none", "sampled", "all", "vote"]
VerificationOutcome = Literal["met", "unmet"]


class ChatMessage(BaseModel):
    """One turn: `tool_calls` only on an assistant's (the calls it made), `tool_call_id` only and always on a
    `tool` message (the answer to that call; its content is the tool's result)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(default="", max_length=max_prompt_chars)
    tool_calls: ToolCallList | None = Field(default=None, exclude_if=_is_none)
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=128, exclude_if=_is_none)

    @model_validator(mode="after")
    def _tool_fields_on_their_roles(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message carries 'tool_calls'")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a 'tool' message, and only one, carries 'tool_call_id'")
        return self

    def for_template(self) -> dict:
        """The message as chat templates read it (tool calls' arguments as objects)."""
        message: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fallback_to_local: bool = True
    # The weight quantization scheme the answer must come from: none, int8, int4 (any group size) or int4/gN;
    # absent: the most precise scheme whose shards cover the model (none, then int8, then int4).
    quantization: QuantizationLabel | None = None
    # How much of the shards' work is checked on other replicas (docs/design.md, "Honest shards"): `none`;
    # `sampled` (a fraction of steps, off the token's path; a refuted step withdraws the tokens after it);
    # `all` (every step also on a second replica before its token goes out); `vote` (two more replicas, majority).
    verify: VerifyLevel = "sampled"


class ChatRequest(BaseModel):
    """One chat call; exactly one of `messages` (chat template applied) or `prompt` (raw text)."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1, max_length=128)
    # May be left out when the mesh serves exactly one model (ModelsReply.default_model).
    model: str | None = Field(default=None, min_length=1, max_length=512)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=max_messages)
    prompt: str | None = Field(default=None, min_length=1, max_length=max_prompt_chars)
    max_tokens: int = Field(default=default_max_tokens, ge=1, le=max_tokens_limit)
    temperature: FiniteFloat = Field(default=0.0, ge=0.0, le=10.0)
    top_p: FiniteFloat = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=max_top_k)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: list[StopString] = Field(default_factory=list, max_length=max_stop_strings)
    # Each token_delta frame carries the sampled token's log-probability and its `top_logprobs` best alternatives.
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=max_top_logprobs)
    # OpenAI's: subtracted from the logit of every token generated so far, once / once per occurrence.
    presence_penalty: FiniteFloat = Field(default=0.0, ge=-max_openai_penalty, le=max_openai_penalty)
    frequency_penalty: FiniteFloat = Field(default=0.0, ge=-max_openai_penalty, le=max_openai_penalty)
    # transformers' (CTRL's): logits of tokens in the prompt or generated are divided by it (multiplied when
    # negative); 1 is off.
    repetition_penalty: FiniteFloat = Field(default=1.0, ge=min_repetition_penalty, le=max_repetition_penalty)
    # Token id -> added to its logit before sampling (-100 bans it in practice, 100 all but forces it).
    logit_bias: dict[BiasedTokenId, LogitBias] = Field(
        default_factory=dict, max_length=max_logit_bias_entries,
        json_schema_extra={"propertyNames": {"pattern": "^[0-9]+$"}})
    # `json_object` or `json_schema`: the answer is JSON (valid against the schema), forced by a grammar.
    response_format: ResponseFormat | None = Field(default=None, exclude_if=_is_none)
    # Functions the model may call (its chat template renders them); `tool_choice` says whether it must.
    tools: ToolList | None = Field(default=None, exclude_if=_is_none)
    tool_choice: ToolChoice | None = Field(default=None, exclude_if=_is_none)
    # Independent answers to the same prompt (frames of each say `choice`; one done frame ends them all). With a
    # `seed`, choice i samples with seed + i.
    n: int = Field(default=1, ge=1, le=max_choices)
    params: ChatParams = Field(default_factory=ChatParams)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_counted_first(cls, value: object) -> object:
        # A dict's max_length is checked after its entries: a body of many wrong ones would be refused entry by entry.
        if isinstance(value, dict) and len(value) > max_logit_bias_entries:
            raise ValueError(f"at most {max_logit_bias_entries} entries (got {len(value)})")
        return value

    @model_validator(mode="after")
    def _tools_agree(self) -> "ChatRequest":
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ValueError("'tool_choice' other than 'none' needs 'tools'")
        if choice is not None and not isinstance(choice, str):
            names = {tool.function.name for tool in self.tools or []}
            if choice.function.name not in names:
                raise ValueError(f"'tool_choice' names function {choice.function.name!r}, which 'tools' does not")
        if self.tools and self.messages is None:
            raise ValueError("'tools' need 'messages': a raw 'prompt' has no chat template to render them")
        calls_tools = bool(self.tools) and choice != "none"
        if calls_tools and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("'response_format' other than text cannot be combined with 'tools' (set "
                             "'tool_choice': 'none' or leave one out)")
        return self

    @model_validator(mode="after")
    def _exactly_one_input(self) -> "ChatRequest":
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("a request carries exactly one of 'messages' or 'prompt'")
        return self

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("'top_logprobs' needs 'logprobs': true")
        return self


class BadRequest(ValueError):
    """A request that cannot be served as sent; the message names the offending field."""


def parse_chat_request(data: bytes) -> ChatRequest:
    """Decode and validate a request, turning any problem into a BadRequest that names the field."""
    try:
        return ChatRequest.model_validate_json(data)
    except ValidationError as error:
        raise BadRequest(describe_validation_error(error)) from None


class _Frame(BaseModel):
    model_config = ConfigDict(extra="ignore")

    seq: int = Field(ge=0)


class PipelineFrame(_Frame):
    type: Literal["pipeline"] = "pipeline"
    pipeline_id: str
    hops: list[str]
    # Which of the request's `n` choices this frame is about (left out for the first).
    choice: int = Field(default=0, ge=0, lt=max_choices, exclude_if=_is_first_choice)


class TokenAlternative(BaseModel):
    """A token and its log-probability at one step (`text`: the token decoded alone)."""

    token_id: int
    text: str
    logprob: float


class TokenLogprobs(BaseModel):
    """The sampled token's log-probability and the best alternatives at its step, most likely first (sent when the
    request asked for `logprobs`). Log-probabilities are those of the logits after `logit_bias` and the penalties,
    before temperature, top-k and top-p; a token the logits rule out entirely (-infinity) is reported as -9999.0, as
    OpenAI does."""

    # The sampled token decoded alone (the frame's `text` is what the stop rules released with it).
    text: str
    logprob: float
    top_logprobs: list[TokenAlternative] = Field(default_factory=list)


class TokenDeltaFrame(_Frame):
    type: Literal["token_delta"] = "token_delta"
    text: str
    token_id: int
    # Which shard hosts ran the step that produced this token (shard ids, in hop order).
    hops: list[str] | None = None
    # Only when the request asked for `logprobs`; absent otherwise.
    logprobs: TokenLogprobs | None = Field(default=None, exclude_if=_is_none)
    # Which of the request's `n` choices this frame is about (left out for the first).
    choice: int = Field(default=0, ge=0, lt=max_choices, exclude_if=_is_first_choice)


class ShardStatusFrame(_Frame):
    type: Literal["shard_status"] = "shard_status"
    shard_id: str
    status: Literal["degraded", "healthy"]
    reason: str
    # Which of the request's `n` choices this frame is about (left out for the first).
    choice: int = Field(default=0, ge=0, lt=max_choices, exclude_if=_is_first_choice)


class ShardFailoverFrame(_Frame):
    type: Literal["shard_failover"] = "shard_failover"
    failed_shard_id: str
    replacement_hops: list[str]
    resumed_at_token: int
    # Which of the request's `n` choices this frame is about (left out for the first).
    choice: int = Field(default=0, ge=0, lt=max_choices, exclude_if=_is_first_choice)


class TokensWithdrawnFrame(_Frame):
    """A check refuted a shard's output at a step the answer already used: the answer is the first `kept_tokens`
    token_delta frames sent, those after them are withdrawn, and the text goes on after the kept ones (a
    shard_failover frame follows)."""

    type: Literal["tokens_withdrawn"] = "tokens_withdrawn"
    kept_tokens: int = Field(ge=0)
    shard_id: str
    reason: str
    # Which of the request's `n` choices this frame is about (left out for the first).
    choice: int = Field(default=0, ge=0, lt=max_choices, exclude_if=_is_first_choice)


class PipelineAbortedFrame(_Frame):
    type: Literal["pipeline_aborted"] = "pipeline_aborted"
    code: ErrorCode
    reason: str
    # Which of the request's `n` choices this frame is about (left out for the first).
    choice: int = Field(default=0, ge=0, lt=max_choices, exclude_if=_is_first_choice)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class Timing(BaseModel):
    model_config = ConfigDict(extra="allow")

    ttft_ms: float | None = None
    # How long the call waited in the orchestrator's queue before it started.
    queue_wait_ms: float | None = None
    tokens_per_second: float | None = None
    duration_ms: float | None = None


class ChoiceEnd(BaseModel):
    """How one of a request's `n` choices ended."""

    choice: int = Field(ge=0, lt=max_choices)
    finish_reason: str
    completion_tokens: int = Field(ge=0)


class DoneFrame(_Frame):
    """The call's last frame when it ended well. With `n` > 1 it ends every choice: `finish_reason` and `timing` are
    the first choice's, `usage.completion_tokens` counts every choice's tokens, and `choices` says how each ended."""

    type: Literal["done"] = "done"
    finish_reason: Literal["stop", "length", "fallback_stop", "fallback_length"] | str
    usage: Usage
    timing: Timing = Field(default_factory=Timing)
    choices: list[ChoiceEnd] | None = Field(default=None, max_length=max_choices, exclude_if=_is_none)
    # The orchestrator that answered (its node id): a conversation's next turn goes to its own subject first.
    orchestrator: str | None = Field(default=None, min_length=1, max_length=max_id_chars, exclude_if=_is_none)
    # `unmet`: some hop's work was not checked as `params.verify` asks (no replica to check it, say); absent at `none`.
    verification: VerificationOutcome | None = Field(default=None, exclude_if=_is_none)


class KeepaliveFrame(_Frame):
    """Sent when no other frame went out for `[transport] keepalive_interval_s` (a slow step, a failover, a head
    loading): a client that hears nothing at all for `[client] silence_timeout_s` knows the orchestrator is gone."""

    type: Literal["keepalive"] = "keepalive"


class QueuedFrame(_Frame):
    """The call waits for room (the mesh runs as many calls as it can); sent when it joins the queue and again
    whenever its place changes. `position` 1 is the next call to start."""

    type: Literal["queued"] = "queued"
    position: int = Field(ge=1)
    # Calls waiting on this orchestrator in all (this one included).
    queued_requests: int = Field(ge=1)


class ErrorFrame(_Frame):
    type: Literal["error"] = "error"
    code: ErrorCode
    message: str
    # With `overloaded`: how long the client should wait before sending the call again.
    retry_after_s: float | None = Field(default=None, ge=0)


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


class ModelsRequest(BaseModel):
    """A request on `llm.models` (an empty body is one too): which models can the mesh serve now?"""

    model_config = ConfigDict(extra="forbid")


class ServedModel(BaseModel):
    """One model the mesh knows of: which of its layers live shard hosts cover right now."""

    id: str
    total_layers: int = Field(ge=0)
    # Inclusive [lo, hi] layer ranges covered by live shards with the same weights, merged and sorted.
    covered_layers: list[tuple[int, int]] = Field(default_factory=list)
    # Every layer is covered: a pipeline can be built now.
    complete: bool
    weights_sha256: str | None = None
    # The weight quantization schemes live shards with those weights cover every layer in, most precise first;
    # covered_layers is of the first of them (or of the scheme that covers most layers when none is complete).
    quantizations: list[str] = Field(default_factory=list)
    # Positions the model takes (prompt plus generated tokens); None when the orchestrator cannot read its config.
    context_length: int | None = None
    # The orchestrator can also run it whole by itself (local fallback).
    runnable_locally: bool = False


class ModelsReply(BaseModel):
    """The answer on `llm.models`; `default_model` is what a request without `model` gets (set when exactly one
    model can be served now)."""

    models: list[ServedModel]
    default_model: str | None = None


DISCOVERY_MESSAGES = (ModelsRequest, ModelsReply)
