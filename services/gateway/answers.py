"""The shape of an answer for each endpoint: the whole object of a non-streamed call, and the server-sent events
of a streamed one (a chunk per token, a last chunk with the finish reason, the usage chunk when asked for, and
`data: [DONE]`). A call that asked for logprobs gets them in OpenAI's form: in the choice of the whole answer, and
in each chunk for that chunk's token (a token whose text is held back, or is none, gets a chunk with empty text).
A chat call that may call tools has its answer read by services/gateway/tool_calls.py: a call becomes `tool_calls`
(streamed as fragments), finish_reason `tool_calls`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel

from protocol.chat import DoneFrame, TokenLogprobs
from services.gateway.logprobs import chat_logprobs, completion_logprobs
from services.gateway.tool_calls import ToolCallBody, ToolCallStream, tool_call_of
from services.gateway.openai_models import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    ChunkDelta,
    Completion,
    CompletionChoice,
    FinishReason,
    UsageBody,
    usage_body,
)

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(model: BaseModel) -> bytes:
    return b"data: " + model.model_dump_json().encode() + b"\n\n"


def finish_reason(done: DoneFrame) -> FinishReason:
    """OpenAI's reasons: a local fallback (`fallback_length`) ends for the same reason as the mesh would."""
    if done.finish_reason.endswith("tool_calls"):
        return "tool_calls"
    return "length" if done.finish_reason.endswith("length") else "stop"


def usage_of(done: DoneFrame, completion_tokens: int | None = None) -> UsageBody:
    """`done`'s usage; `completion_tokens`: the answer's own count where it differs (tokens were withdrawn)."""
    return usage_body(done.usage.prompt_tokens,
                      done.usage.completion_tokens if completion_tokens is None else completion_tokens)


@dataclass
class ChatShape:
    """/v1/chat/completions: `chat.completion`, streamed as `chat.completion.chunk`s (`tools`: the answer may be a
    tool call)."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    tools: bool = False
    _tool_stream: ToolCallStream = field(default_factory=ToolCallStream)

    def whole(self, text: str, done: DoneFrame, logprobs: Sequence[TokenLogprobs] | None = None,
              completion_tokens: int | None = None) -> ChatCompletion:
        """The answer; `logprobs`: its tokens' log-probabilities (None: the call asked for none);
        `completion_tokens`: its tokens, when tokens were withdrawn (None: `done`'s count)."""
        call = tool_call_of(text) if self.tools and finish_reason(done) == "tool_calls" else None
        message = (AssistantMessage(content=None, tool_calls=[call]) if call is not None
                   else AssistantMessage(content=text))
        return ChatCompletion(id=self.id, created=self.created, model=self.model,
                              usage=usage_of(done, completion_tokens),
                              choices=[ChatChoice(message=message, finish_reason=finish_reason(done),
                                                  logprobs=None if logprobs is None else chat_logprobs(logprobs))])

    def _chunk(self, delta: ChunkDelta, reason: FinishReason | None = None,
               logprobs: TokenLogprobs | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[
            ChunkChoice(delta=delta, finish_reason=reason,
                        logprobs=None if logprobs is None else chat_logprobs([logprobs]))])

    def opening(self) -> ChatCompletionChunk | None:
        return self._chunk(ChunkDelta(role="assistant", content=""))

    def text(self, text: str, logprobs: TokenLogprobs | None = None) -> ChatCompletionChunk | None:
        """The chunk of a token's text (None: a tool call's text held back for now)."""
        if not self.tools:
            return self._chunk(ChunkDelta(content=text), logprobs=logprobs)
        content, calls = self._tool_stream.take(text)
        return self._delta(content, calls, logprobs)

    def held_back(self) -> ChatCompletionChunk | None:
        """What a tool call's stream still held when the answer ended (None: nothing)."""
        if not self.tools:
            return None
        content, calls = self._tool_stream.finish()
        return self._delta(content, calls, None)

    def _delta(self, content: str, calls: list[ToolCallBody], logprobs) -> ChatCompletionChunk | None:
        if not content and not calls and logprobs is None:
            return None
        return self._chunk(ChunkDelta(content=content if content or not calls else None, tool_calls=calls or None),
                           logprobs=logprobs)

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
    # Characters of the completion's tokens streamed so far: where the next chunk's `text_offset` starts.
    streamed_chars: int = 0

    def whole(self, text: str, done: DoneFrame, logprobs: Sequence[TokenLogprobs] | None = None,
              completion_tokens: int | None = None) -> Completion:
        """The answer; `logprobs`: its tokens' log-probabilities (None: the call asked for none);
        `completion_tokens`: its tokens, when tokens were withdrawn (None: `done`'s count)."""
        return Completion(id=self.id, created=self.created, model=self.model,
                          usage=usage_of(done, completion_tokens), choices=[
            CompletionChoice(text=text, finish_reason=finish_reason(done),
                             logprobs=None if logprobs is None else completion_logprobs(logprobs))])

    def _chunk(self, text: str, reason: FinishReason | None = None) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model,
                          choices=[CompletionChoice(text=text, finish_reason=reason)])

    def opening(self) -> Completion | None:
        return None

    def text(self, text: str, logprobs: TokenLogprobs | None = None) -> Completion:
        if logprobs is None:
            return self._chunk(text)
        chunk_logprobs = completion_logprobs([logprobs], self.streamed_chars)
        self.streamed_chars += len(logprobs.text)
        return Completion(id=self.id, created=self.created, model=self.model,
                          choices=[CompletionChoice(text=text, logprobs=chunk_logprobs)])

    def held_back(self) -> Completion | None:
        return None

    def ending(self, done: DoneFrame) -> Completion:
        return self._chunk("", finish_reason(done))

    def usage(self, done: DoneFrame) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=usage_of(done))


AnswerShape = ChatShape | CompletionShape
