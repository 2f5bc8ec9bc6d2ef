"""Step assembly of docs/design.md §6: one step's tensor -> chunked frames (encode_step), and frames -> the step again.

A step is cut into ``n`` chunks of at most ``chunk_bytes`` (default TransportSettings.chunk_bytes, never
above the server's ``max_payload`` minus room for headers); each chunk travels as one frame whose
headers (services.transport.headers) say where its bytes go. Chunks may arrive in any order and are put
back together by their byte offset (StepAssembler); the wire bytes themselves are services.transport.wire's.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from hearth.services.common.config import TransportSettings
from hearth.services.transport.errors import FrameError
from hearth.services.transport.headers import (
    HEADER_BYTES,
    HEADER_OFFSET,
    FrameHeader,
    FrameKind,
    StepInfo,
    max_header_bytes,
)
from hearth.services.transport.wire import WireDtype, decode_payload, encode_payload

_defaults = TransportSettings()

# NATS max_payload bounds headers + payload together, so a chunk leaves this much room for the headers.
header_budget_bytes = max_header_bytes


def effective_chunk_bytes(requested_bytes: int | None, max_payload_bytes: int | None) -> int:
    """The chunk size to use: the request (default TransportSettings.chunk_bytes), capped so headers + payload
    fit max_payload."""
    chunk = _defaults.chunk_bytes if requested_bytes is None else requested_bytes
    if chunk < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk}")
    if max_payload_bytes is not None:
        room = max_payload_bytes - header_budget_bytes
        if room < 1:
            raise ValueError(f"server max_payload {max_payload_bytes} leaves no room for frame headers")
        chunk = min(chunk, room)
    return chunk


@dataclass(frozen=True)
class EncodedStep:
    """One step's wire bytes cut into chunks (zero-copy memoryviews when no dtype change was needed)."""

    info: StepInfo
    dtype: WireDtype | None
    compute_dtype: WireDtype | None
    shape: tuple[int, ...] | None
    int8_block: int | None
    total_bytes: int
    chunks: tuple[memoryview, ...]
    offsets: tuple[int, ...]
    # Keeps the tensor whose memory the chunks view alive until the step is published.
    _owner: Any = field(default=None, repr=False, compare=False)

    @property
    def chunk_count(self) -> int:
        return len(self.chunks)

    def header(self, pipeline_id: str, hop: int, chunk_index: int, *, sent_ns: int | None = None) -> FrameHeader:
        # Not validated again: encode_step made these fields consistent, and the receiver validates every frame.
        # (Run once per step on every hop, with caches cold after the layers, where validation is slow.)
        return FrameHeader.model_construct(
            pipeline_id=pipeline_id,
            hop=hop,
            session=self.info.session,
            step=self.info.step,
            kind=self.info.kind,
            pos=self.info.pos,
            prompt_tokens=self.info.prompt_tokens,
            chunk_index=chunk_index,
            chunk_count=self.chunk_count,
            dtype=self.dtype,
            compute_dtype=self.compute_dtype,
            shape=self.shape,
            offset=self.offsets[chunk_index],
            total_bytes=self.total_bytes,
            int8_block=self.int8_block,
            sent_ns=sent_ns,
        )


def encode_step(
    info: StepInfo,
    tensor: torch.Tensor | None,
    *,
    wire_dtype: WireDtype | None = None,
    chunk_bytes: int = _defaults.chunk_bytes,
    int8_block: int = _defaults.int8_block_elems,
) -> EncodedStep:
    """Turn a step's tensor into wire chunks; `wire_dtype=None` keeps the tensor's dtype (lossless)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if info.kind is FrameKind.reset:
        if tensor is not None:
            raise ValueError("a reset step carries no tensor")
        return EncodedStep(info, None, None, None, None, 0, (memoryview(b""),), (0,))
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"a {info.kind.value} step needs a torch.Tensor, got {type(tensor).__name__}")
    wire, compute, block, payload, view = encode_payload(tensor, wire_dtype, int8_block)
    total = view.nbytes
    offsets = tuple(range(0, total, chunk_bytes)) or (0,)
    chunks = tuple(view[offset : offset + chunk_bytes] for offset in offsets)
    return EncodedStep(info, wire, compute, tuple(tensor.shape), block, total, chunks, offsets, _owner=payload)


class AddOutcome(enum.Enum):
    added = "added"
    duplicate = "duplicate"
    complete = "complete"


class StepAssembler:
    """Collects the chunks of one step, in any order, into one buffer; then restores the tensor."""

    def __init__(self, first: FrameHeader) -> None:
        self.header = first
        self.received: set[int] = set()
        self.received_bytes = 0
        # One buffer per step, made on the first chunk: each chunk is copied in once, the tensor then views it.
        self.buffer: bytearray | None = None
        self.first_sent_ns: int | None = None

    def add(self, header: FrameHeader, payload: bytes | memoryview) -> AddOutcome:
        """Place one chunk; FrameError when it disagrees with the step's other chunks or overflows."""
        first = self.header
        if (
            header.chunk_count != first.chunk_count
            or header.kind is not first.kind
            or header.pos != first.pos
            or header.prompt_tokens != first.prompt_tokens
            or header.dtype is not first.dtype
            or header.compute_dtype is not first.compute_dtype
            or header.shape != first.shape
            or header.total_bytes != first.total_bytes
            or header.int8_block != first.int8_block
        ):
            raise FrameError(
                f"chunk {header.chunk_index}/{header.chunk_count} of step {header.step} (session "
                f"{header.session}) disagrees with the step's first chunk on kind/pos/prompt tokens/dtype/shape/size"
            )
        if header.chunk_index in self.received:
            return AddOutcome.duplicate
        size = len(payload)
        end = header.offset + size
        if end > first.total_bytes:
            raise FrameError(
                f"chunk {header.chunk_index}/{header.chunk_count} of step {header.step}: payload of {size} bytes "
                f"at {HEADER_OFFSET} {header.offset} overflows {HEADER_BYTES} {first.total_bytes}"
            )
        if size:
            if self.buffer is None and first.chunk_count == 1 and header.offset == 0:
                self.buffer = bytearray(payload)  # a decode step: one copy, no zero-filled buffer first
            else:
                if self.buffer is None:
                    self.buffer = bytearray(first.total_bytes)
                self.buffer[header.offset : end] = payload
        self.received.add(header.chunk_index)
        self.received_bytes += size
        if header.sent_ns is not None and (self.first_sent_ns is None or header.sent_ns < self.first_sent_ns):
            self.first_sent_ns = header.sent_ns
        if len(self.received) < first.chunk_count:
            return AddOutcome.added
        if self.received_bytes != first.total_bytes:
            raise FrameError(
                f"step {header.step} (session {header.session}): {first.chunk_count} chunks carried "
                f"{self.received_bytes} bytes, {HEADER_BYTES} says {first.total_bytes}"
            )
        return AddOutcome.complete

    def tensor(self) -> torch.Tensor | None:
        """The restored tensor in its compute dtype (None for a reset step); call once the step is complete."""
        header = self.header
        if header.dtype is None or header.shape is None:  # a reset step (FrameHeader validated the rest)
            return None
        buffer = self.buffer if self.buffer is not None else bytearray()
        restored = header.restored_dtype or header.dtype
        return decode_payload(header.dtype, restored, header.shape, header.int8_block, buffer)


def decode_frames(frames: Iterable[tuple[FrameHeader, bytes | memoryview]]) -> tuple[StepInfo, torch.Tensor | None]:
    """Reassemble one step from all of its frames, in any order (the pure counterpart of the receiver)."""
    assembler: StepAssembler | None = None
    for header, payload in frames:
        if assembler is None:
            assembler = StepAssembler(header)
        elif (header.session, header.step) != (assembler.header.session, assembler.header.step):
            raise FrameError(
                f"frames of two steps mixed: ({header.session}, {header.step}) and "
                f"({assembler.header.session}, {assembler.header.step})"
            )
        assembler.add(header, payload)
    if assembler is None:
        raise FrameError("no frames to decode")
    if len(assembler.received) < assembler.header.chunk_count:
        missing = sorted(set(range(assembler.header.chunk_count)) - assembler.received)
        raise FrameError(f"step {assembler.header.step} is missing chunks {missing}")
    return assembler.header.info, assembler.tensor()


@dataclass(frozen=True)
class ReceivedStep:
    """One complete step: its header (as sent in chunk 0), the restored tensor (None for reset) and timings."""

    header: FrameHeader
    tensor: torch.Tensor | None
    first_sent_ns: int | None
    completed_ns: int
    wire_s: float | None
    decode_s: float

    @property
    def info(self) -> StepInfo:
        return self.header.info

    @property
    def session(self) -> str:
        return self.header.session

    @property
    def step(self) -> int:
        return self.header.step

    @property
    def kind(self) -> FrameKind:
        return self.header.kind

    @property
    def pos(self) -> int:
        return self.header.pos

    @property
    def prompt_tokens(self) -> int | None:
        return self.header.prompt_tokens

    @property
    def wire_dtype(self) -> WireDtype | None:
        return self.header.dtype
