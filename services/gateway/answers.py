"""The shape of an answer for each endpoint: the whole object of a non-streamed call, and the server-sent events
of a streamed one (a chunk per token, a last chunk with the finish reason, the usage chunk when asked for, and
`data: [DONE]`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel

from protocol.chat import DoneFrame
from services.gateway.openai_models import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    ChunkDelta,
    Completion,
    CompletionChoice,
    UsageBody,
    usage_body,
)

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(model: BaseModel) -> bytes:
    return b"data: " + model.model_dump_json().encode() + b"\n\n"


def finish_reason(done: DoneFrame) -> Literal["stop", "length"]:
    """OpenAI's two reasons: a local fallback (`fallback_length`) ends for the same reason as the mesh would."""
    return "length" if done.finish_reason.endswith("length") else "stop"


def usage_of(done: DoneFrame) -> UsageBody:
    return usage_body(done.usage.prompt_tokens, done.usage.completion_tokens)


@dataclass
class ChatShape:
    """/v1/chat/completions: `chat.completion`, streamed as `chat.completion.chunk`s."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def whole(self, text: str, done: DoneFrame) -> ChatCompletion:
        return ChatCompletion(id=self.id, created=self.created, model=self.model, usage=usage_of(done),
                              choices=[ChatChoice(message=AssistantMessage(content=text),
                                                  finish_reason=finish_reason(done))])

    def _chunk(self, delta: ChunkDelta, reason: Literal["stop", "length"] | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   choices=[ChunkChoice(delta=delta, finish_reason=reason)])

    def opening(self) -> ChatCompletionChunk | None:
        return self._chunk(ChunkDelta(role="assistant", content=""))

    def text(self, text: str) -> ChatCompletionChunk:
        return self._chunk(ChunkDelta(content=text))

    def ending(self, done: DoneFrame) -> ChatCompletionChunk:
        return self._chunk(ChunkDelta(), finish_reason(done))

    def usage(self, done: DoneFrame) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                   usage=usage_of(done))


@dataclass
class CompletionShape:
    """/v1/completions: `text_completion`, streamed as `text_completion` chunks."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def whole(self, text: str, done: DoneFrame) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, usage=usage_of(done),
                          choices=[CompletionChoice(text=text, finish_reason=finish_reason(done))])

    def _chunk(self, text: str, reason: Literal["stop", "length"] | None = None) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model,
                          choices=[CompletionChoice(text=text, finish_reason=reason)])

    def opening(self) -> Completion | None:
        return None

    def text(self, text: str) -> Completion:
        return self._chunk(text)

    def ending(self, done: DoneFrame) -> Completion:
        return self._chunk("", finish_reason(done))

    def usage(self, done: DoneFrame) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=usage_of(done))


AnswerShape = ChatShape | CompletionShape
