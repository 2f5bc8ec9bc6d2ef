"""OpenAI's `logprobs` objects, built from the log-probabilities hearth's token_delta frames carry: the chat form
(`content[]` of token, logprob, bytes, top_logprobs) and the completions form (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`).

A token is named by its text decoded alone; `bytes` are that text's UTF-8 (a token that is only part of a
multi-byte character decodes to U+FFFD, whose bytes are given). `text_offset` counts characters of the completion
from its start (the prompt is not echoed).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel

from hearth.protocol.chat_frames import TokenLogprobs


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ContentLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """`choices[].logprobs` of a chat completion (and of each streamed chunk: that chunk's tokens)."""

    content: list[ContentLogprob] | None = None
    refusal: list[ContentLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """`choices[].logprobs` of a text completion (and of each streamed chunk: that chunk's tokens)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(steps: Sequence[TokenLogprobs]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ContentLogprob(token=step.text, logprob=step.logprob, bytes=_utf8(step.text), top_logprobs=[
            TopLogprob(token=alternative.text, logprob=alternative.logprob, bytes=_utf8(alternative.text))
            for alternative in step.top_logprobs])
        for step in steps])


def completion_logprobs(steps: Sequence[TokenLogprobs], start_offset: int = 0) -> CompletionLogprobs:
    """The completions form of `steps`, whose first token starts `start_offset` characters into the completion."""
    offsets = []
    offset = start_offset
    tops = []
    for step in steps:
        offsets.append(offset)
        offset += len(step.text)
        top: dict[str, float] = {}
        for alternative in step.top_logprobs:
            # Keyed by text, so tokens that decode alike share one key: it keeps the most likely one's.
            top.setdefault(alternative.text, alternative.logprob)
        tops.append(top)
    return CompletionLogprobs(tokens=[step.text for step in steps], token_logprobs=[step.logprob for step in steps],
                              top_logprobs=tops, text_offset=offsets)
