"""The OpenAI request bodies the gateway takes, of /v1/chat/completions and /v1/completions, and their mapping onto
hearth's `llm.chat.request` (the objects and stream chunks it answers with are openai_answers.py).

Only what hearth can honour is accepted: a field that would change the answer in a way hearth cannot (`n` over 8,
the legacy `functions`, `audio`, `moderation`, a content part that is no text) is refused with a message naming it,
rather than silently ignored; OpenAI's fields that change nothing (`user`, `metadata`, `store`) are accepted, and a
field OpenAI's API does not know (misspelt, another server's extension), at the top level or inside one of its
objects (openai_parts.py), is refused as OpenAI refuses it. `n` (1-8) asks for that many choices, each its own
pipeline. `response_format`, `tools` and `tool_choice` go onto the request as hearth's (hearth/protocol/chat_tools.py
bounds them); assistant messages with `tool_calls` and `tool` messages are part of the history.
`logprobs`/`top_logprobs`, the penalties (`repetition_penalty` too, an extension, as is `top_k`) and `logit_bias` go
onto the request as they are (its validation bounds them, a refusal naming the field). Sampling defaults are
OpenAI's (temperature 1, top_p 1); `max_tokens` left out stays out (the answer runs to hearth's 128 tokens or the
context's end, whichever comes first). hearth's own options, which no other server shares, come in one object
`hearth` (`{"hearth": {"verify": "all"}}`), so they cannot collide with a field OpenAI adds, and a misspelt one is
refused rather than ignored.
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hearth.protocol.chat import (
    BadRequest,
    ChatParams,
    ChatRequest,
    VerifyLevel,
    describe_validation_error,
    max_choices,
    max_logit_bias_entries,
    max_messages,
    max_tokens_limit,
    max_top_logprobs,
)
from hearth.protocol.chat_tools import ResponseFormat, ToolChoiceMode
from hearth.protocol.quantization_labels import QuantizationLabel
from hearth.protocol.refusals import array_too_long
from hearth.services.gateway.openai_parts import (
    CacheHint, FailFastList, Metadata, OpenAIMessage, OpenAITools, OpenAIToolChoice, Prediction, StreamOptions,
    UnknownParameter, Unsupported, shortened, unknown_parameter,
)

openai_temperature_max = 2.0
openai_max_stop_strings = 4
openai_seed_bound = 2**63
# OpenAI's fields of each endpoint that ask nothing hearth could honour or refuse (who calls, what to store, hints
# for OpenAI's own models and caches): accepted, and change nothing (those that are objects are declared, so that
# their keys are checked). Any other field the body model does not declare is one OpenAI's API does not know either,
# and is refused by name, as OpenAI refuses it.
CHAT_FIELDS_THAT_CHANGE_NOTHING = frozenset({
    "user", "store", "service_tier", "parallel_tool_calls", "reasoning_effort", "verbosity", "prompt_cache_key",
    "prompt_cache_retention", "safety_identifier"})
COMPLETION_FIELDS_THAT_CHANGE_NOTHING = frozenset({"user"})


class HearthOptions(BaseModel):
    """`hearth`: the body's object of hearth's own options, each mapped onto `params` of `llm.chat.request`."""

    model_config = ConfigDict(extra="forbid")

    # params.verify: how much of the shards' work other replicas check (absent: the request's default).
    verify: VerifyLevel | None = None
    # params.quantization: the weight scheme the answer must come from (absent: the most precise fully covered).
    quantization: QuantizationLabel | None = None

    def params(self) -> ChatParams:
        return ChatParams(**self.model_dump(exclude_none=True))


class _Sampling(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(default=None, min_length=1, max_length=512)
    max_tokens: int | None = Field(default=None, ge=1, le=max_tokens_limit)
    temperature: float | None = Field(default=None, ge=0.0, le=openai_temperature_max)
    # OpenAI's range: 0 is the most likely token only, the greedy answer.
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    # OpenAI's range, a 64-bit signed integer; hearth's seeds are 0 to 2**63 - 1 (_chat_request carries it there).
    seed: int | None = Field(default=None, ge=-openai_seed_bound, lt=openai_seed_bound)
    stop: str | FailFastList[str] | None = None
    n: int | None = Field(default=None, ge=1)
    # Every optional field takes null, as OpenAI's API does: left out.
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Extensions of OpenAI's API (transformers' and vLLM's names).
    repetition_penalty: float | None = None
    top_k: int | None = None
    # Its values are bounded by llm.chat.request's validation; here only how many, counted before any is read.
    logit_bias: dict[str, Any] | None = Field(default=None, max_length=max_logit_bias_entries)
    # hearth's own options (HearthOptions), checked when mapped so that a refusal names the option.
    hearth: dict[str, Any] | None = None

    # The fields of OpenAI's that this endpoint accepts and that change nothing.
    fields_that_change_nothing: ClassVar[frozenset[str]] = frozenset()

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _refuse_what_hearth_cannot_do(self) -> None:
        unknown = [name for name in self.model_extra or {} if name not in self.fields_that_change_nothing]
        if unknown:
            # OpenAI's words for it. The name is the client's own: a long one is cut in the message, and not `param`.
            more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
            raise UnknownParameter(unknown[0], f"Unrecognized request argument supplied: {shortened(unknown[0])}{more}")
        if self.n is not None and self.n > max_choices:
            raise Unsupported("n", f"'n' must be at most {max_choices}: hearth answers at most {max_choices} choices "
                                   f"per request (got {self.n})")
        if isinstance(self.stop, list) and len(self.stop) > openai_max_stop_strings:
            # In the mesh's words and reason for a list over its bound: answered as OpenAI does (errors.refused).
            raise Unsupported("stop", f"field 'stop': {array_too_long(openai_max_stop_strings, len(self.stop))} "
                                      "(OpenAI's API takes at most that many stop strings)", "array_too_long")

    def _chat_request(self, *, max_tokens: int | None, **inputs: Any) -> ChatRequest:
        greedy = self.top_p == 0  # hearth's top_p must keep some mass: the greedy answer is what 0 asks for
        fields: dict[str, Any] = {
            "request_id": uuid.uuid4().hex, "model": self.model,
            "temperature": 0.0 if greedy else 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if greedy or self.top_p is None else self.top_p,
            "seed": None if self.seed is None else self.seed % openai_seed_bound,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []), **inputs}
        if max_tokens is not None:
            fields["max_tokens"] = max_tokens
        for name in ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "top_k", "logit_bias"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.hearth:
            fields["params"] = self._hearth_options().params()
        try:
            return ChatRequest(**fields)
        except ValidationError as error:
            # The request's fields carry the body's names: the field refused is the one the client sent.
            raise BadRequest.of_validation(error) from None

    def _hearth_options(self) -> HearthOptions:
        try:
            return _HearthField.model_validate({"hearth": self.hearth}).hearth
        except ValidationError as error:
            first = error.errors(include_url=False)[0]["loc"]
            raise unknown_parameter(error, {"hearth": self.hearth}) or Unsupported(
                ".".join(str(part) for part in first), describe_validation_error(error)) from None


class _HearthField(BaseModel):
    """The body's `hearth` alone, so that a refusal names each option as `hearth.NAME`."""

    hearth: HearthOptions


class ChatCompletionRequest(_Sampling):
    """The body of POST /v1/chat/completions."""

    fields_that_change_nothing = CHAT_FIELDS_THAT_CHANGE_NOTHING

    messages: list[OpenAIMessage] = Field(min_length=1, max_length=max_messages)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=max_tokens_limit)
    tools: OpenAITools | None = None
    tool_choice: ToolChoiceMode | OpenAIToolChoice | None = None
    functions: FailFastList[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=max_top_logprobs)
    # What answers hearth cannot give (audio, a web search): refused, never answered with text alone.
    modalities: FailFastList[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    # OpenAI's objects that change nothing here, declared so that their keys and values are checked.
    metadata: Metadata | None = None
    prediction: Prediction | None = None
    prompt_cache_options: CacheHint | None = None

    def to_chat_request(self) -> ChatRequest:
        self._refuse_what_hearth_cannot_do()
        if self.functions or self.function_call not in (None, "none"):
            raise Unsupported("functions", "'functions' and 'function_call' (deprecated by OpenAI) are not supported "
                                           "by hearth: send 'tools' and 'tool_choice'")
        if set(self.modalities or []) - {"text"}:
            raise Unsupported("modalities", "hearth answers in text only: 'modalities' may only be [\"text\"]")
        if self.audio is not None:
            raise Unsupported("audio", "'audio' is not supported by hearth: its answers are text")
        if self.web_search_options is not None:
            raise Unsupported("web_search_options", "'web_search_options' is not supported by hearth: it does not "
                                                    "search the web")
        if self.moderation is not None:
            raise Unsupported("moderation", "'moderation' is not supported by hearth: it runs no moderation of the "
                                            "input or the answer")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        structured: dict[str, Any] = {}
        if self.response_format is not None:
            structured["response_format"] = self.response_format
        if self.tools is not None:
            structured["tools"] = [tool.to_tool(index) for index, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            structured["tool_choice"] = (self.tool_choice if isinstance(self.tool_choice, str)
                                         else self.tool_choice.to_named_tool_choice())
        try:
            messages = [message.to_chat_message(index) for index, message in enumerate(self.messages)]
        except ValidationError as error:
            raise BadRequest.of_validation(error, "messages") from None
        return self._chat_request(max_tokens=max_tokens, messages=messages, logprobs=bool(self.logprobs),
                                  top_logprobs=self.top_logprobs or 0, **structured)

    @property
    def may_call_tools(self) -> bool:
        """Whether the answer may be a tool call (its text then becomes `tool_calls`)."""
        return bool(self.tools) and self.tool_choice != "none"


class CompletionRequest(_Sampling):
    """The body of POST /v1/completions (the legacy text completion)."""

    fields_that_change_nothing = COMPLETION_FIELDS_THAT_CHANGE_NOTHING

    prompt: str | FailFastList[str]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    # How many most likely tokens to report beside each sampled one (0: the sampled token's only); None: no logprobs.
    logprobs: int | None = Field(default=None, ge=0, le=max_top_logprobs)

    def to_chat_request(self) -> ChatRequest:
        self._refuse_what_hearth_cannot_do()
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise Unsupported("prompt", "'prompt' must be one string: hearth completes one prompt per request")
        if self.echo or self.suffix or self.best_of not in (None, 1):
            raise Unsupported("echo", "'echo', 'suffix' and 'best_of' are not supported by hearth")
        prompt = self.prompt[0] if isinstance(self.prompt, list) else self.prompt
        return self._chat_request(max_tokens=self.max_tokens, prompt=prompt, logprobs=self.logprobs is not None,
                                  top_logprobs=self.logprobs or 0)
