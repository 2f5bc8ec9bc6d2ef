"""AnswerDelivery, mixed into GatewayApp: how a call's answer leaves the gateway once its first token or final frame
came, either whole (one JSON body) or as server-sent events chunk by chunk (SseResponse), each choice opened, its
withdrawn tokens and the mesh's failures told, and the stream ended by `data: [DONE]` or an error event."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack, aclosing

import anyio
from starlette.responses import JSONResponse, Response, StreamingResponse

from hearth.protocol.chat_frames import DoneFrame, TokenDeltaFrame, TokensWithdrawnFrame
from hearth.services.client.chat import AnswerTokens, choice_of
from hearth.services.gateway.answers import SSE_DONE, AnswerShape, ChoiceAnswer, sse_event, verification_headers
from hearth.services.gateway.errors import GatewayError, tokens_withdrawn
from hearth.services.gateway.http_metrics import first_token_seconds
from hearth.services.gateway.mesh import AnswerFrame, MeshCall

# The app's logger: what a stream's ending logs goes out under the name it always did.
log = logging.getLogger("hearth.services.gateway.app")


class SseResponse(StreamingResponse):
    """Server-sent events of one call; the call is closed however the response ends (a disconnect cancels the
    stream, possibly before its first event: the events' own `finally` would then never run)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], call: MeshCall, slot: ExitStack) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.call = call
        self.slot = slot

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self.call.aclose()
            self.slot.close()


class AnswerDelivery:
    """Mixed into GatewayApp: reads its gateway (its stops) and its `_error` and `_unforeseen`."""

    async def _whole(self, call: MeshCall, shape: AnswerShape, first: AnswerFrame, answers: list[AnswerTokens],
                     with_logprobs: bool) -> Response:
        withdrawals = False
        frame = first
        while isinstance(frame, (TokenDeltaFrame, TokensWithdrawnFrame)):
            _take(answers, frame)
            withdrawals = withdrawals or isinstance(frame, TokensWithdrawnFrame)
            frame = await call.next()
        if not isinstance(frame, DoneFrame):
            raise self._error(frame)
        choices = [ChoiceAnswer(answer.text, [token.logprobs for token in answer.frames if token.logprobs is not None]
                                if with_logprobs else None) for answer in answers]
        return JSONResponse(shape.whole_choices(choices, frame, _kept_tokens(answers, withdrawals)).model_dump(),
                            headers=verification_headers(frame))

    async def _events(self, route: str, call: MeshCall, shape: AnswerShape, first: AnswerFrame,
                      answers: list[AnswerTokens], include_usage: bool) -> AsyncIterator[bytes]:
        async with aclosing(self._events_of_answer(route, call, shape, first, answers, include_usage)) as events:
            try:
                async for event in events:
                    yield event
            except GatewayError as error:
                log.info("%s: stream ended by %s", route, error)
                yield sse_event(error.body())
            except Exception as error:
                # Too late for a status: an error event, which the client raises, not a stream that just stops.
                yield sse_event(self._unforeseen(route, error).body())

    async def _events_of_answer(self, route: str, call: MeshCall, shape: AnswerShape, first: AnswerFrame,
                                answers: list[AnswerTokens], include_usage: bool) -> AsyncIterator[bytes]:
        # Per choice: tokens of its answer up to the last one that made a chunk (what a withdrawal must not reach).
        shown_tokens = [0] * len(answers)
        opened: set[int] = set()
        withdrawals = False
        frame = first
        while isinstance(frame, (TokenDeltaFrame, TokensWithdrawnFrame)):
            answer = _take(answers, frame)
            if answer is None:
                pass  # a choice the request did not ask for: nothing of it is shown
            elif isinstance(frame, TokensWithdrawnFrame):
                withdrawals = True
                if frame.kept_tokens < shown_tokens[answer.choice]:
                    # Sent chunks cannot be taken back: the client must learn the text is not to be trusted.
                    error = tokens_withdrawn(frame, len(answer.text))
                    log.info("%s: stream ended by %s", route, error)
                    yield sse_event(error.body())
                    return
            else:
                # A choice's opening chunk goes with its first token: one write less before that token. The token
                # is read first: whether it opens a tool call decides the opening's content.
                piece = shape.text(frame.text, frame.logprobs, answer.choice) if _carries(frame) else None
                chunk = _opening(shape, answer.choice, opened)
                if piece is not None:
                    shown_tokens[answer.choice] = len(answer.frames)
                    chunk += sse_event(piece)
                if chunk:
                    yield chunk
                if frame is first:
                    first_token_seconds.labels(route).observe(time.perf_counter() - call.started)
            async with self.gateway.stops.watch():
                frame = await call.next()
        if isinstance(frame, DoneFrame):
            ending = b""
            for choice in range(len(answers)):
                ending += _opening(shape, choice, opened)
                rest = shape.held_back(choice)
                if rest is not None:
                    ending += sse_event(rest)
                ending += sse_event(shape.ending(frame, choice))
            if include_usage:
                ending += sse_event(shape.usage(frame, _kept_tokens(answers, withdrawals)))
            yield ending
            yield SSE_DONE
        else:
            # Too late for an HTTP status: the stream ends with an error event, as OpenAI's does.
            error = self._error(frame)
            log.info("%s: stream ended by %s", route, error)
            yield sse_event(error.body())


def _take(answers: list[AnswerTokens], frame: TokenDeltaFrame | TokensWithdrawnFrame) -> AnswerTokens | None:
    """The answer of `frame`'s choice, `frame` applied to it (None: a choice the request did not ask for)."""
    choice = choice_of(frame)
    if choice >= len(answers):
        return None
    answers[choice].take(frame)
    return answers[choice]


def _kept_tokens(answers: list[AnswerTokens], withdrawals: bool) -> int | None:
    """The answer's tokens that stand, every choice's, when some were withdrawn (None: the orchestrator's count)."""
    return sum(len(answer.frames) for answer in answers) if withdrawals else None


def _opening(shape: AnswerShape, choice: int, opened: set[int]) -> bytes:
    """`choice`'s opening event the first time it is asked for (nothing after, nor where the shape has none)."""
    if choice in opened:
        return b""
    opened.add(choice)
    opening = shape.opening(choice)
    return sse_event(opening) if opening is not None else b""


def _carries(frame: TokenDeltaFrame) -> bool:
    """Whether a token's frame makes a chunk: it has text, or the log-probabilities of its token."""
    return bool(frame.text) or frame.logprobs is not None
