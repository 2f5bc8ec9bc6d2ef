"""The client protocol of docs/protocol.md: the `llm.chat.request` message, its bounds and its validation."""

from __future__ import annotations

import sys
import uuid
from typing import Annotated, Literal

from pydantic import AfterValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from hearth.protocol.chat_tools import (
    ClosedObject, ResponseFormat, ToolCallList, ToolChoice, ToolList, max_tool_call_id_chars,
)
from hearth.protocol.quantization_labels import QuantizationLabel
from hearth.protocol.refusals import (
    FieldsDisagree, RefusalReason, describe_validation_error, refused_field, validation_reason,
)

max_tokens_limit = 8192
# What a call generates at most when it does not say, fewer where the model's context leaves fewer
# (hearth/inference/sampling.py mirrors it).
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
max_temperature = 10.0
# Seeds are below this (a signed 64-bit integer's range, what torch's generators take).
seed_limit = 2**63


def _not_subnormal(value: float) -> float:
    # A subnormal temperature (1e-320) overflows every logit it divides; such values are never meant.
    if value != 0.0 and abs(value) < sys.float_info.min:
        raise ValueError(f"subnormal numbers (below {sys.float_info.min:.3g} in magnitude) are not accepted")
    return value


def is_none(value: object) -> bool:
    """Whether an optional field is unset (`exclude_if`: such fields are left out of the JSON)."""
    return value is None


# Finite (no NaN, no Infinity) and not subnormal: what a sampling parameter may be.
FiniteFloat = Annotated[float, Field(allow_inf_nan=False), AfterValidator(_not_subnormal)]
StopString = Annotated[str, Field(min_length=1, max_length=max_stop_chars)]
BiasedTokenId = Annotated[int, Field(ge=0, le=max_top_k)]
LogitBias = Annotated[float, Field(allow_inf_nan=False, ge=-max_logit_bias, le=max_logit_bias),
                      AfterValidator(_not_subnormal)]

# How much of the shards' work a call has checked on other replicas (ChatParams.verify).
VerifyLevel = Literal["none", "sampled", "all", "vote"]


class ChatMessage(ClosedObject):
    """One turn: `tool_calls` only on an assistant's (the calls it made), `tool_call_id` only and always on a
    `tool` message (the answer to that call; its content is the tool's result)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(default="", max_length=max_prompt_chars)
    tool_calls: ToolCallList | None = Field(default=None, exclude_if=is_none)
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=max_tool_call_id_chars, exclude_if=is_none)

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


class ChatParams(ClosedObject):
    model_config = ConfigDict(extra="forbid")

    fallback_to_local: bool = True
    # The weight quantization scheme the answer must come from: none, int8, int4 (any group size) or int4/gN;
    # absent: the most precise scheme whose shards cover the model (none, then int8, then int4).
    quantization: QuantizationLabel | None = None
    # How much of the shards' work is checked on other replicas (docs/design.md, "Honest shards"): `none`;
    # `sampled` (a fraction of steps, off the token's path; a refuted step withdraws the tokens after it);
    # `all` (every step also on a second replica before its token goes out); `vote` (two more replicas, majority).
    verify: VerifyLevel = "sampled"


class ChatRequest(ClosedObject):
    """One chat call; exactly one of `messages` (chat template applied) or `prompt` (raw text)."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1, max_length=128)
    # May be left out when the mesh serves exactly one model (ModelsReply.default_model).
    model: str | None = Field(default=None, min_length=1, max_length=512)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=max_messages)
    prompt: str | None = Field(default=None, min_length=1, max_length=max_prompt_chars)
    # Absent: at most default_max_tokens, fewer where the context leaves fewer (the orchestrator sets it once the
    # prompt is tokenized, ChatRequest.fitted_to_context), as OpenAI's API runs to the context's end.
    max_tokens: int | None = Field(default=None, ge=1, le=max_tokens_limit, exclude_if=is_none)
    temperature: FiniteFloat = Field(default=0.0, ge=0.0, le=max_temperature)
    top_p: FiniteFloat = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=max_top_k)
    seed: int | None = Field(default=None, ge=0, lt=seed_limit)
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
    response_format: ResponseFormat | None = Field(default=None, exclude_if=is_none)
    # Functions the model may call (its chat template renders them); `tool_choice` says whether it must.
    tools: ToolList | None = Field(default=None, exclude_if=is_none)
    tool_choice: ToolChoice | None = Field(default=None, exclude_if=is_none)
    # Independent answers to the same prompt (frames of each say `choice`; one done frame ends them all). With a
    # `seed`, choice i samples with seed + i.
    n: int = Field(default=1, ge=1, le=max_choices)
    params: ChatParams = Field(default_factory=ChatParams)

    @property
    def most_tokens(self) -> int:
        """The most tokens a choice of this call may generate: `max_tokens`, else the default it cannot exceed."""
        return default_max_tokens if self.max_tokens is None else self.max_tokens

    def fitted_to_context(self, prompt_tokens: int, context_length: int | None) -> "ChatRequest":
        """This request with `max_tokens` set: as sent, else the default or what the context leaves after
        `prompt_tokens` when that is fewer (admission made sure it leaves at least one)."""
        if self.max_tokens is not None:
            return self
        room = default_max_tokens if context_length is None else context_length - prompt_tokens
        return self.model_copy(update={"max_tokens": max(1, min(default_max_tokens, room))})

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
            raise FieldsDisagree("tool_choice", "'tool_choice' other than 'none' needs 'tools'")
        if choice is not None and not isinstance(choice, str):
            names = {tool.function.name for tool in self.tools or []}
            if choice.function.name not in names:
                raise FieldsDisagree("tool_choice", f"'tool_choice' names function {choice.function.name!r}, which "
                                                    "'tools' does not")
        if self.tools and self.messages is None:
            raise FieldsDisagree("tools", "'tools' need 'messages': a raw 'prompt' has no chat template to render "
                                          "them")
        calls_tools = bool(self.tools) and choice != "none"
        if calls_tools and self.response_format is not None and self.response_format.type != "text":
            raise FieldsDisagree("response_format", "'response_format' other than text cannot be combined with "
                                                    "'tools' (set 'tool_choice': 'none' or leave one out)")
        return self

    @model_validator(mode="after")
    def _exactly_one_input(self) -> "ChatRequest":
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("a request carries exactly one of 'messages' or 'prompt'")
        return self

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatRequest":
        if self.top_logprobs and not self.logprobs:
            raise FieldsDisagree("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        return self


class BadRequest(ValueError):
    """A request that cannot be served as sent; the message names the offending field, `param` names it for a
    program (its top-level name: OpenAI's `param`), and `reason` says why where a client acts on it."""

    def __init__(self, message: str, *, param: str | None = None, reason: RefusalReason | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.reason = reason

    @classmethod
    def of_validation(cls, error: ValidationError, param: str | None = None) -> "BadRequest":
        """The refusal of what `error` refused, naming `param` (else the first field it refused)."""
        return cls(describe_validation_error(error), param=param or refused_field(error),
                   reason=validation_reason(error))


def parse_chat_request(data: bytes) -> ChatRequest:
    """Decode and validate a request, turning any problem into a BadRequest that names the field."""
    try:
        return ChatRequest.model_validate_json(data)
    except ValidationError as error:
        raise BadRequest.of_validation(error) from None
