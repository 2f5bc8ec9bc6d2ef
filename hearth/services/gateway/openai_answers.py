"""The OpenAI objects the gateway answers with: a chat completion, a text completion and their stream chunks, the
model list, and the error object every error answer is."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

from hearth.protocol.chat_frames import VerificationOutcome
from hearth.services.gateway.logprobs import ChatLogprobs, CompletionLogprobs
from hearth.services.gateway.tool_calls import ToolCallBody

class UsageBody(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def usage_body(prompt_tokens: int, completion_tokens: int) -> UsageBody:
    return UsageBody(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    # None when the answer is a tool call (as OpenAI sends it).
    content: str | None
    tool_calls: list[ToolCallBody] | None = Field(default=None, exclude_if=lambda value: value is None)


FinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None = None


def _is_none(value: object) -> bool:
    return value is None


class _Verified(BaseModel):
    """An answer, or a stream's chunk sent once the call ended, that says whether the call's hops were checked as
    its `hearth.verify` asked: hearth's extension field, absent at `none` (OpenAI's clients keep a field they do not
    know: openai-python's `model_extra`)."""

    hearth_verification: VerificationOutcome | None = Field(default=None, exclude_if=_is_none)


class ChatCompletion(_Verified):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageBody


class ChunkDelta(BaseModel):
    """What one chunk adds: the role in the first, text in the others, nothing in the last (as OpenAI sends)."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=_is_none)
    content: str | None = Field(default=None, exclude_if=_is_none)
    tool_calls: list[ToolCallBody] | None = Field(default=None, exclude_if=_is_none)


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Verified):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: UsageBody | None = Field(default=None, exclude_if=_is_none)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(_Verified):
    """A text completion, and (object `text_completion` too, as OpenAI sends it) one chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageBody | None = Field(default=None, exclude_if=_is_none)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "hearth"
    # hearth's extension: the weight schemes live shards serve the model whole in now, most precise first (what
    # `hearth.quantization` may name; `quantizations` of llm.models), empty for one only an orchestrator runs locally.
    hearth_quantizations: list[str] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """What every error answer is: `{"error": {...}}`, as OpenAI's API and its clients expect."""

    error: ErrorDetail
