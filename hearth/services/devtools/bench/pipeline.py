"""The distributed side: one greedy raw-prompt request through the orchestrator, timed at the client per token."""

from __future__ import annotations

import contextlib
import time

from hearth.services.devtools.bench.errors import BenchError
from hearth.services.devtools.bench.timing import GenerationTiming


async def pipeline_generation(nc, model_ref: str, prompt: str, new_tokens: int, *,
                              refusal_is_error: bool = True, verify: str | None = None,
                              **timeouts: float) -> GenerationTiming:
    """One raw-prompt greedy request through the orchestrator, timed at the client, asking for verification level
    `verify` (None: asking none, the protocol's default applies); a call that does not complete raises BenchError,
    or (`refusal_is_error` False) comes back with its `error_code`."""
    from hearth.services.client.answer_bound import within_bound
    from hearth.services.client.chat import stream_chat_raw
    from hearth.protocol.chat import ChatRequest
    from hearth.protocol.chat_frames import (
        DoneFrame, ErrorFrame, PipelineAbortedFrame, QueuedFrame, TokenDeltaFrame, TokensWithdrawnFrame,
    )

    request = ChatRequest(model=model_ref, prompt=prompt, max_tokens=new_tokens, temperature=0.0,
                          params={"fallback_to_local": False, **({"verify": verify} if verify else {})})
    timing = GenerationTiming()
    started = time.perf_counter()
    # Within the request's bound: a frame past it ends the call as an internal_error (answer_bound.py).
    frames = within_bound(stream_chat_raw(nc, request.model_dump_json(exclude_none=True).encode(), **timeouts),
                          request)
    async with contextlib.aclosing(frames):
        async for frame in frames:
            if isinstance(frame, TokenDeltaFrame):
                timing.token_times_s.append(time.perf_counter() - started)
                timing.token_ids.append(frame.token_id)
            elif isinstance(frame, TokensWithdrawnFrame):  # a refuted step's tokens are no part of the answer
                del timing.token_times_s[frame.kept_tokens:]
                del timing.token_ids[frame.kept_tokens:]
            elif isinstance(frame, QueuedFrame):
                timing.queue_positions.append(frame.position)
            elif isinstance(frame, DoneFrame):
                timing.construct_ms = getattr(frame.timing, "construct_ms", None)
                timing.queue_wait_ms = frame.timing.queue_wait_ms
                return timing
            elif isinstance(frame, (ErrorFrame, PipelineAbortedFrame)):
                if refusal_is_error:
                    raise BenchError(f"pipeline request failed: {frame.model_dump_json()}")
                timing.error_code = frame.code
                return timing
    raise BenchError("the frame stream ended without `done`")
