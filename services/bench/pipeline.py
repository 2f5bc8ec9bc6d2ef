"""The distributed side: one greedy raw-prompt request through the orchestrator, timed at the client per token."""

from __future__ import annotations

import contextlib
import time

from services.bench.errors import BenchError
from services.bench.timing import GenerationTiming


async def pipeline_generation(nc, model_ref: str, prompt: str, new_tokens: int) -> GenerationTiming:
    """One raw-prompt greedy request through the orchestrator, timed at the client."""
    from services.common.chat_client import stream_chat_raw
    from services.common.chat_protocol import ChatRequest, DoneFrame, ErrorFrame, PipelineAbortedFrame, TokenDeltaFrame

    request = ChatRequest(model=model_ref, prompt=prompt, max_tokens=new_tokens, temperature=0.0,
                          params={"fallback_to_local": False})
    timing = GenerationTiming()
    started = time.perf_counter()
    frames = stream_chat_raw(nc, request.model_dump_json(exclude_none=True).encode())
    async with contextlib.aclosing(frames):
        async for frame in frames:
            if isinstance(frame, TokenDeltaFrame):
                timing.token_times_s.append(time.perf_counter() - started)
                timing.token_ids.append(frame.token_id)
            elif isinstance(frame, DoneFrame):
                timing.construct_ms = getattr(frame.timing, "construct_ms", None)
                return timing
            elif isinstance(frame, (ErrorFrame, PipelineAbortedFrame)):
                raise BenchError(f"pipeline request failed: {frame.model_dump_json()}")
    raise BenchError("the frame stream ended without `done`")
