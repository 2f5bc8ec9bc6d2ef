"""A small async client for `llm.chat.request`: publish a request, iterate the frames from its inbox."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from nats.aio.client import Client as NatsClient

from services.common.lifecycle import run_event_loop
from services.common.chat_protocol import (
    CHAT_REQUEST_SUBJECT,
    FINAL_FRAME_TYPES,
    ChatFrame,
    ChatRequest,
    DoneFrame,
    ErrorFrame,
    PipelineAbortedFrame,
    TokenDeltaFrame,
    decode_frame,
)

# Generous: the first frame can wait for a model head to load on the orchestrator.
first_frame_timeout_s = 120.0
frame_gap_timeout_s = 60.0


class ChatTimeout(TimeoutError):
    """No frame arrived within the allowed gap."""


async def stream_chat_raw(
    nc: NatsClient,
    payload: bytes,
    *,
    first_frame_timeout: float = first_frame_timeout_s,
    frame_gap_timeout: float = frame_gap_timeout_s,
) -> AsyncIterator[ChatFrame]:
    """Publish raw request bytes (valid or not) and yield frames until a final one; for tests and tools."""
    inbox = nc.new_inbox()
    subscription = await nc.subscribe(inbox)
    try:
        await nc.publish(CHAT_REQUEST_SUBJECT, payload, reply=inbox)
        timeout = first_frame_timeout
        while True:
            try:
                message = await subscription.next_msg(timeout=timeout)
            except (asyncio.TimeoutError, TimeoutError) as error:
                raise ChatTimeout(f"no frame from the orchestrator within {timeout} s") from error
            frame = decode_frame(message.data)
            yield frame
            if frame.type in FINAL_FRAME_TYPES:
                return
            timeout = frame_gap_timeout
    finally:
        await subscription.unsubscribe()


async def stream_chat(nc: NatsClient, request: ChatRequest, **timeouts: float) -> AsyncIterator[ChatFrame]:
    payload = request.model_dump_json(exclude_none=True).encode()
    # aclosing: a caller that stops early unsubscribes the inbox now, not at garbage collection.
    async with contextlib.aclosing(stream_chat_raw(nc, payload, **timeouts)) as frames:
        async for frame in frames:
            yield frame


@dataclass
class ChatResult:
    """Everything one call streamed, collected."""

    frames: list[ChatFrame] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(f.text for f in self.frames if isinstance(f, TokenDeltaFrame))

    @property
    def token_ids(self) -> list[int]:
        return [f.token_id for f in self.frames if isinstance(f, TokenDeltaFrame)]

    @property
    def final(self) -> ChatFrame | None:
        return self.frames[-1] if self.frames else None

    @property
    def ok(self) -> bool:
        return isinstance(self.final, DoneFrame)

    def frames_of(self, frame_type: str) -> list[ChatFrame]:
        return [f for f in self.frames if f.type == frame_type]

    @property
    def error(self) -> ErrorFrame | PipelineAbortedFrame | None:
        final = self.final
        return final if isinstance(final, (ErrorFrame, PipelineAbortedFrame)) else None


async def chat(nc: NatsClient, request: ChatRequest, **timeouts: float) -> ChatResult:
    result = ChatResult()
    async for frame in stream_chat(nc, request, **timeouts):
        result.frames.append(frame)
    return result


def run_chat_command(nats_url: str, *, prompt: str, model: str, max_tokens: int, temperature: float,
                     seed: int | None, raw: bool, as_json: bool) -> int:
    """`hearth chat`: stream one answer to stdout; exit code 0 on `done`, 1 on an error frame, 2 on timeout."""
    import sys

    from services.common.chat_protocol import ChatMessage
    from services.common.nats_connection import connect_nats

    if raw:
        request = ChatRequest(model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature, seed=seed)
    else:
        request = ChatRequest(model=model, messages=[ChatMessage(role="user", content=prompt)],
                              max_tokens=max_tokens, temperature=temperature, seed=seed)

    async def run() -> int:
        nc = await connect_nats(nats_url, name="hearth-chat")
        try:
            async for frame in stream_chat(nc, request):
                if as_json:
                    print(frame.model_dump_json(exclude_none=True), flush=True)
                elif isinstance(frame, TokenDeltaFrame):
                    sys.stdout.write(frame.text)
                    sys.stdout.flush()
                elif isinstance(frame, DoneFrame):
                    timing = frame.timing
                    print(f"\n[{frame.finish_reason}: {frame.usage.completion_tokens} tokens, "
                          f"{timing.tokens_per_second or 0:.1f} tokens/s, ttft {timing.ttft_ms or 0:.0f} ms]",
                          file=sys.stderr)
                elif isinstance(frame, (ErrorFrame, PipelineAbortedFrame)):
                    message = frame.message if isinstance(frame, ErrorFrame) else frame.reason
                    print(f"\nerror {frame.code}: {message}", file=sys.stderr)
                    return 1
                elif frame.type in ("shard_status", "shard_failover"):
                    print(f"\n[{frame.type}: {frame.model_dump_json(exclude={'seq', 'type'})}]", file=sys.stderr)
            return 0
        except ChatTimeout as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        finally:
            await nc.close()

    return run_event_loop(run())
