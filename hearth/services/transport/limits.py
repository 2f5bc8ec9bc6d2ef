"""StepLimits: what a step's declared shape, dtype, positions and chunk count may be on one pipeline link, checked
from a frame's headers before the receiver allocates anything for the step.

Every activation of a pipeline is `[1, tokens, hidden_size]`: `hidden_size` is the model's, `tokens` at least 1
(exactly 1 for a decode step), and no position beyond the session's `max_tokens` (the prompt plus `max_tokens` of
the call; `OpenHop`'s `max_session_tokens` on a shard). Its wire dtype is what the pipeline's `activation_dtype`
setting makes (auto: the sender's compute dtype, any float). So a step's size is bounded by the pipeline, not by
what a frame claims: a frame claiming a gigabyte, a million chunks, an empty tensor or another hidden size is
refused at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hearth.services.common.config import TransportSettings, smallest_chunk_bytes
from hearth.services.transport.headers import (
    HEADER_CHUNK, HEADER_DTYPE, HEADER_POS, HEADER_PROMPT_TOKENS, HEADER_SHAPE, FrameHeader, FrameKind,
)
from hearth.services.transport.wire import WireDtype, wire_dtype_from_setting

_FLOAT_DTYPES = frozenset({WireDtype.float32, WireDtype.bfloat16, WireDtype.float16})
# Largest wire bytes per element: float32 (4), or int8 (1) plus its float32 scale when a block is one element.
_max_bytes_per_element = 5


@dataclass(frozen=True)
class StepRefusal:
    """Why a frame cannot belong to its pipeline: `reason` is a short label (for the metric), `message` names the
    header and the numbers."""

    reason: str
    message: str


@dataclass(frozen=True)
class StepLimits:
    """The steps one receiver may take in; `refusal(header)` says why a frame's step does not fit, or None."""

    hidden_size: int
    max_tokens: int
    wire_dtypes: frozenset[WireDtype] = _FLOAT_DTYPES

    @classmethod
    def for_pipeline(cls, *, hidden_size: int, max_tokens: int, activation_dtype: str = "auto") -> "StepLimits":
        """The limits of a pipeline of a model with `hidden_size`, sessions of at most `max_tokens` positions,
        and the `activation_dtype` setting (`auto`, `fp16`, `fp32`, `int8`) every sender of it uses."""
        wire = wire_dtype_from_setting(activation_dtype)
        return cls(hidden_size=hidden_size, max_tokens=max_tokens,
                   wire_dtypes=_FLOAT_DTYPES if wire is None else frozenset({wire}))

    @property
    def max_step_bytes(self) -> int:
        """The largest wire payload a step of this pipeline can have."""
        return self.max_tokens * self.hidden_size * _max_bytes_per_element

    @property
    def max_chunks(self) -> int:
        """The most chunks a step of this pipeline can come in (the largest, in chunks of the smallest size)."""
        return math.ceil(self.max_step_bytes / smallest_chunk_bytes)

    def refusal(self, header: FrameHeader) -> StepRefusal | None:
        if header.kind is FrameKind.reset:
            return None
        shape = header.shape or ()
        if len(shape) != 3 or shape[0] != 1 or shape[2] != self.hidden_size:
            return StepRefusal("shape", f"{HEADER_SHAPE} {','.join(map(str, shape))} is not "
                                        f"1,<tokens>,{self.hidden_size}")
        tokens = shape[1]
        if tokens < 1:
            return StepRefusal("shape", f"{HEADER_SHAPE} {','.join(map(str, shape))} carries no tokens")
        if header.kind is FrameKind.decode and tokens != 1:
            # A call decodes one token per step; a longer "decode" would run whole on the compute thread (never in
            # turns, as a prefill or replay does) and hold every other session for its length.
            return StepRefusal("shape", f"{HEADER_SHAPE} {','.join(map(str, shape))}: a decode step carries one "
                                        "token")
        if header.pos + tokens > self.max_tokens:
            return StepRefusal("positions", f"{HEADER_POS} {header.pos} + {tokens} tokens goes beyond the "
                                            f"session's {self.max_tokens} positions")
        if header.prompt_tokens is not None and not header.pos + tokens <= header.prompt_tokens <= self.max_tokens:
            return StepRefusal("positions", f"{HEADER_PROMPT_TOKENS} {header.prompt_tokens} does not hold "
                                            f"{HEADER_POS} {header.pos} + {tokens} tokens within the session's "
                                            f"{self.max_tokens} positions")
        if header.dtype not in self.wire_dtypes:
            allowed = ", ".join(sorted(dtype.value for dtype in self.wire_dtypes))
            return StepRefusal("dtype", f"{HEADER_DTYPE} {header.dtype.value if header.dtype else None} is not "
                                        f"this pipeline's ({allowed})")
        most_chunks = max(1, math.ceil(header.total_bytes / smallest_chunk_bytes))
        if header.chunk_count > most_chunks:
            return StepRefusal("chunks", f"{HEADER_CHUNK} count {header.chunk_count} for {header.total_bytes} "
                                         f"bytes (at most {most_chunks} chunks of {smallest_chunk_bytes} bytes)")
        return None


def receiver_settings(transport: TransportSettings) -> dict:
    """The `[transport]` bounds of an ActivationReceiver, as keyword arguments: what a host configured applies to every
    receiver of its process, a shard's hops and an orchestrator's sinks and taps alike."""
    return {"max_ready_steps": transport.max_ready_steps, "ready_wait_timeout_s": transport.ready_wait_timeout_s,
            "max_step_bytes": transport.max_step_bytes, "max_partial_steps": transport.max_partial_steps,
            "max_tracked_sessions": transport.max_tracked_sessions}
