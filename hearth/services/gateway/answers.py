"""The shape of an answer for each endpoint: the whole object of a non-streamed call, and the server-sent events
of a streamed one (a chunk per token, a last chunk with the finish reason, the usage chunk when asked for, and
`data: [DONE]`). The whole object and the chunks sent once the call ended say its `hearth_verification`. A call
that asked for logprobs gets them in OpenAI's form: in the choice of the whole answer, and in each chunk for that
chunk's token (a token whose text is held back, or is none, gets a chunk with empty text).
A chat call that may call tools has its answer read by hearth/services/gateway/tool_calls.py: a call becomes
`tool_calls` (streamed as fragments), finish_reason `tool_calls`. A call with `n` > 1 has a choice per answer (`index`
i, its own finish reason, logprobs and tool call); streamed, each choice's chunks carry its index, interleaved as they
come."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel

from hearth.protocol.chat_frames import DoneFrame, TokenLogprobs
from hearth.services.gateway.logprobs import chat_logprobs, completion_logprobs
from hearth.services.gateway.tool_calls import ToolCallBody, ToolCallStream, call_so_far, tool_call_of
from hearth.services.gateway.openai_answers import (
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
# Whether the call's hops were checked as its `verify` level asks (the done frame's `verification`: `met` / `unmet`),
# as a header of a whole answer (a streamed one's headers go out before its last frame), besides the answer's (and a
# stream's last chunks') `hearth_verification`.
VERIFICATION_HEADER = "Hearth-Verification"


def sse_event(model: BaseModel) -> bytes:
    return b"data: " + model.model_dump_json().encode() + b"\n\n"


def finish_reason(done: DoneFrame, choice: int = 0) -> FinishReason:
    """OpenAI's reason for how `choice` ended (the done frame's `choices` say, else the frame's own reason): a
    local fallback (`fallback_length`) ends for the same reason as the mesh would."""
    reason = next((end.finish_reason for end in done.choices or [] if end.choice == choice), done.finish_reason)
    if reason.endswith("tool_calls"):
        return "tool_calls"
    return "length" if reason.endswith("length") else "stop"


def verification_headers(done: DoneFrame) -> dict[str, str] | None:
    """The headers of a whole answer that tell how its `verify` level was held to (None: level `none`)."""
    return None if done.verification is None else {VERIFICATION_HEADER: done.verification}


def usage_of(done: DoneFrame, completion_tokens: int | None = None) -> UsageBody:
    """`done`'s usage (every choice's tokens); `completion_tokens`: the answer's own count where it differs (tokens
    were withdrawn)."""
    return usage_body(done.usage.prompt_tokens,
                      done.usage.completion_tokens if completion_tokens is None else completion_tokens)


@dataclass
class ChoiceAnswer:
    """One choice's answer as the call ended: its text, and its tokens' log-probabilities (None: none asked for)."""

    text: str
    logprobs: Sequence[TokenLogprobs] | None = None


@dataclass
class ChatShape:
    """/v1/chat/completions: `chat.completion`, streamed as `chat.completion.chunk`s (`tools`: an answer may be a
    tool call). Each choice's stream is its own: its opening chunk, its text, its ending."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    tools: bool = False
    _tool_streams: dict[int, ToolCallStream] = field(default_factory=dict)

    def whole(self, text: str, done: DoneFrame, logprobs: Sequence[TokenLogprobs] | None = None,
              completion_tokens: int | None = None) -> ChatCompletion:
        """The answer of one choice; `logprobs`: its tokens' log-probabilities (None: the call asked for none);
        `completion_tokens`: its tokens, when tokens were withdrawn (None: `done`'s count)."""
        return self.whole_choices([ChoiceAnswer(text, logprobs)], done, completion_tokens)

    def whole_choices(self, answers: Sequence[ChoiceAnswer], done: DoneFrame,
                      completion_tokens: int | None = None) -> ChatCompletion:
        """The answer, `answers[i]` being choice i's; `completion_tokens`: all choices' tokens, when tokens were
        withdrawn (None: `done`'s count)."""
        choices = []
        for index, answer in enumerate(answers):
            reason = finish_reason(done, index)
            call = self._call_of(answer.text, reason)
            message = (AssistantMessage(content=None, tool_calls=[call]) if call is not None
                       else AssistantMessage(content=answer.text))
            choices.append(ChatChoice(index=index, message=message, finish_reason=reason, logprobs=None
                                      if answer.logprobs is None else chat_logprobs(answer.logprobs)))
        return ChatCompletion(id=self.id, created=self.created, model=self.model,
                              usage=usage_of(done, completion_tokens), choices=choices,
                              hearth_verification=done.verification)

    def _call_of(self, text: str, reason: FinishReason) -> ToolCallBody | None:
        """The tool call a whole answer makes (None: text): a call the grammar completed, else what its stream
        would have sent (a call cut in its arguments)."""
        if not self.tools:
            return None
        return (tool_call_of(text) if reason == "tool_calls" else None) or call_so_far(text)

    def _chunk(self, delta: ChunkDelta, choice: int, reason: FinishReason | None = None,
               logprobs: TokenLogprobs | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[
            ChunkChoice(index=choice, delta=delta, finish_reason=reason,
                        logprobs=None if logprobs is None else chat_logprobs([logprobs]))])

    def opening(self, choice: int = 0) -> ChatCompletionChunk | None:
        """The role chunk, sent with the choice's first token (after `text` read it): its `content` is null when
        that token opened a tool call, as OpenAI sends it, else "" (a client adds the text to it)."""
        is_call = self.tools and self._tool_stream(choice).is_call
        return self._chunk(ChunkDelta(role="assistant", content=None if is_call else ""), choice)

    def text(self, text: str, logprobs: TokenLogprobs | None = None, choice: int = 0) -> ChatCompletionChunk | None:
        """The chunk of a token's text (None: a tool call's text held back for now)."""
        if not self.tools:
            return self._chunk(ChunkDelta(content=text), choice, logprobs=logprobs)
        content, calls = self._tool_stream(choice).take(text)
        return self._delta(content, calls, logprobs, choice)

    def held_back(self, choice: int = 0) -> ChatCompletionChunk | None:
        """What a tool call's stream still held when the answer ended (None: nothing)."""
        if not self.tools:
            return None
        content, calls = self._tool_stream(choice).finish()
        return self._delta(content, calls, None, choice)

    def _tool_stream(self, choice: int) -> ToolCallStream:
        return self._tool_streams.setdefault(choice, ToolCallStream())

    def _delta(self, content: str, calls: list[ToolCallBody], logprobs, choice: int) -> ChatCompletionChunk | None:
        if not content and not calls and logprobs is None:
            return None
        return self._chunk(ChunkDelta(content=content if content or not calls else None, tool_calls=calls or None),
                           choice, logprobs=logprobs)

    def ending(self, done: DoneFrame, choice: int = 0) -> ChatCompletionChunk:
        """`choice`'s last chunk: its finish reason, and the call's verification."""
        ending = self._chunk(ChunkDelta(), choice, finish_reason(done, choice))
        ending.hearth_verification = done.verification
        return ending

    def usage(self, done: DoneFrame, completion_tokens: int | None = None) -> ChatCompletionChunk:
        """The usage chunk (with the call's verification); `completion_tokens`: the answer's, when tokens were
        withdrawn (None: `done`'s)."""
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                   usage=usage_of(done, completion_tokens), hearth_verification=done.verification)


@dataclass
class CompletionShape:
    """/v1/completions: `text_completion`, streamed as `text_completion` chunks."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    # Characters of each choice's tokens streamed so far: where its next chunk's `text_offset` starts.
    _streamed_chars: dict[int, int] = field(default_factory=dict)

    def whole(self, text: str, done: DoneFrame, logprobs: Sequence[TokenLogprobs] | None = None,
              completion_tokens: int | None = None) -> Completion:
        """The answer of one choice; `logprobs`: its tokens' log-probabilities (None: the call asked for none);
        `completion_tokens`: its tokens, when tokens were withdrawn (None: `done`'s count)."""
        return self.whole_choices([ChoiceAnswer(text, logprobs)], done, completion_tokens)

    def whole_choices(self, answers: Sequence[ChoiceAnswer], done: DoneFrame,
                      completion_tokens: int | None = None) -> Completion:
        """The answer, `answers[i]` being choice i's; `completion_tokens`: all choices' tokens, when tokens were
        withdrawn (None: `done`'s count)."""
        return Completion(id=self.id, created=self.created, model=self.model,
                          usage=usage_of(done, completion_tokens), hearth_verification=done.verification, choices=[
            CompletionChoice(index=index, text=answer.text, finish_reason=finish_reason(done, index),
                             logprobs=None if answer.logprobs is None else completion_logprobs(answer.logprobs))
            for index, answer in enumerate(answers)])

    def _chunk(self, text: str, choice: int, reason: FinishReason | None = None) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model,
                          choices=[CompletionChoice(index=choice, text=text, finish_reason=reason)])

    def opening(self, choice: int = 0) -> Completion | None:
        return None

    def text(self, text: str, logprobs: TokenLogprobs | None = None, choice: int = 0) -> Completion:
        if logprobs is None:
            return self._chunk(text, choice)
        streamed = self._streamed_chars.get(choice, 0)
        chunk_logprobs = completion_logprobs([logprobs], streamed)
        self._streamed_chars[choice] = streamed + len(logprobs.text)
        return Completion(id=self.id, created=self.created, model=self.model,
                          choices=[CompletionChoice(index=choice, text=text, logprobs=chunk_logprobs)])

    def held_back(self, choice: int = 0) -> Completion | None:
        return None

    def ending(self, done: DoneFrame, choice: int = 0) -> Completion:
        """`choice`'s last chunk: its finish reason, and the call's verification."""
        ending = self._chunk("", choice, finish_reason(done, choice))
        ending.hearth_verification = done.verification
        return ending

    def usage(self, done: DoneFrame, completion_tokens: int | None = None) -> Completion:
        """The usage chunk (with the call's verification); `completion_tokens`: the answer's, when tokens were
        withdrawn (None: `done`'s)."""
        return Completion(id=self.id, created=self.created, model=self.model, choices=[],
                          usage=usage_of(done, completion_tokens), hearth_verification=done.verification)


AnswerShape = ChatShape | CompletionShape
