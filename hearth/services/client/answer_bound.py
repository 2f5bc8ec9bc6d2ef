"""The most answer a request lets a correct orchestrator send (token frames, text and withdrawals, per choice), and
the check every Python client makes of the frames it reads against it (docs/protocol.md, "Reading a frame": "How long
an answer may be")."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from hearth.protocol.chat import ChatRequest, max_stop_chars
from hearth.protocol.chat_frames import (
    ChatFrame,
    ErrorFrame,
    TokenDeltaFrame,
    TokensWithdrawnFrame,
    max_withdrawals_per_choice,
)

log = logging.getLogger(__name__)

# UTF-8 bytes one token's text may average over a choice's answer: twice 64, as real vocabularies hold longer tokens
# than 64 bytes (SmolLM's: a newline and 80 spaces, 81 bytes), and a banner of them must not end an honest answer.
max_text_bytes_per_token = 128
# Besides: text the stop rules held back goes out with a later token (a stop string's worth, at most 4 bytes a
# character), as does a character whose bytes spanned tokens.
held_back_slack_bytes = 4 * max_stop_chars


def max_answer_text_bytes(max_tokens: int) -> int:
    """The most UTF-8 bytes of text a choice of `max_tokens` tokens may stand at."""
    return max_tokens * max_text_bytes_per_token + held_back_slack_bytes


class AnswerTooLong(Exception):
    """A choice's answer grew past what its request lets a correct orchestrator send: the orchestrator is hostile or
    broken, and the call is ended rather than held or streamed on."""

    def __init__(self, choice: int, overrun: str) -> None:
        self.choice = choice
        super().__init__(f"the orchestrator sent choice {choice} {overrun}: no correct orchestrator does, so the call "
                         "was ended")


@dataclass
class _ChoiceSize:
    """The text bytes of each token frame of one choice's answer as it stands, and its tokens_withdrawn frames."""

    token_bytes: list[int] = field(default_factory=list)
    text_bytes: int = 0
    withdrawals: int = 0


class AnswerBound:
    """Each choice's answer as it stands (token frames less those a tokens_withdrawn frame took back) against the
    request's bound: at most `max_tokens` token frames (a correct orchestrator sends one per token at most: held back
    text rides on a later token's frame, and a token that ends the call with no text sends none), at most
    max_answer_text_bytes(max_tokens) of text, and no token of a choice the request did not ask for; and at most
    max_withdrawals_per_choice tokens_withdrawn frames a choice (a reader that shows the kept text again after each
    shows it at most that often)."""

    def __init__(self, max_tokens: int, choices: int = 1) -> None:
        self.max_tokens = max_tokens
        self.max_text_bytes = max_answer_text_bytes(max_tokens)
        self._choices = [_ChoiceSize() for _ in range(choices)]

    @classmethod
    def of(cls, request: ChatRequest) -> "AnswerBound":
        return cls(request.most_tokens, request.n)

    def take(self, frame: ChatFrame) -> None:
        """Count `frame` in its choice's answer; AnswerTooLong when that is now past the bound."""
        if not isinstance(frame, (TokenDeltaFrame, TokensWithdrawnFrame)):
            return
        choice = frame.choice
        if choice >= len(self._choices):
            if isinstance(frame, TokenDeltaFrame):
                raise AnswerTooLong(choice, f"a token, but the request asked for {len(self._choices)} choices")
            return
        size = self._choices[choice]
        if isinstance(frame, TokensWithdrawnFrame):
            if size.withdrawals >= max_withdrawals_per_choice:
                raise AnswerTooLong(choice, f"more than {max_withdrawals_per_choice} tokens_withdrawn frames, the "
                                            "most the protocol lets a choice have")
            size.withdrawals += 1
            size.text_bytes -= sum(size.token_bytes[frame.kept_tokens:])
            del size.token_bytes[frame.kept_tokens:]
            return
        if len(size.token_bytes) >= self.max_tokens:
            raise AnswerTooLong(choice, f"more token frames than the request's max_tokens {self.max_tokens}")
        # Counted in characters first: a frame of megabytes is refused without encoding it.
        text_bytes = (len(frame.text) if len(frame.text) > self.max_text_bytes
                      else len(frame.text.encode("utf-8", "surrogatepass")))
        if size.text_bytes + text_bytes > self.max_text_bytes:
            raise AnswerTooLong(choice, f"more than {self.max_text_bytes} bytes of text, the most max_tokens "
                                        f"{self.max_tokens} allows ({max_text_bytes_per_token} bytes a token, and "
                                        f"{held_back_slack_bytes} of held-back text)")
        size.token_bytes.append(text_bytes)
        size.text_bytes += text_bytes


def warn_answer_too_long(error: AnswerTooLong, request_id: str, asked_first: str | None) -> None:
    """The WARNING an operator finds the orchestrator by: the one the call was sent to first (the one that answered
    unless that one could not take it), and the request id its `pipeline.constructed` event carries with its node id
    (a call to the queue group learns its orchestrator's name only from the done frame)."""
    sent_to = f"orchestrator {asked_first}" if asked_first else "the orchestrator of the queue group that took it"
    log.warning("request %s, sent to %s: %s (its pipeline.constructed event names the orchestrator that answered)",
                request_id, sent_to, error)


async def within_bound(frames: AsyncGenerator[ChatFrame, None], request: ChatRequest,
                       asked_first: str | None = None) -> AsyncIterator[ChatFrame]:
    """`frames` (a call of `request`'s) as they come, up to the first that takes its choice's answer past the bound:
    that one is replaced by an `internal_error` frame of the client's own, which ends the call (and the WARNING is
    logged), as the gateway ends it; for readers that collect or show frames (ChatResult, `hearth demo`, `hearth
    bench`). `frames` is closed when this ends."""
    bound = AnswerBound.of(request)
    async with contextlib.aclosing(frames):
        async for frame in frames:
            try:
                bound.take(frame)
            except AnswerTooLong as error:
                warn_answer_too_long(error, request.request_id, asked_first)
                yield ErrorFrame(seq=frame.seq, code="internal_error", message=str(error))
                return
            yield frame
