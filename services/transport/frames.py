"""Activation frames of DESIGN.md §6: the FrameHeader <-> NATS headers mapping, and tensor <-> chunked raw bytes.

Wire format
-----------
One frame is one core-NATS message on ``hearth.act.<pipeline_id>.<hop>``. Its headers carry the
metadata below; its payload is a slice of the step's raw little-endian tensor bytes (no JSON, no
base64). A step is cut into ``n`` chunks of at most ``chunk_bytes`` (default 1 MiB, never above the
server's ``max_payload`` minus room for headers); chunks may arrive in any order and are put back
together by their byte offset.

=====================  ==========================================================================
header                 meaning
=====================  ==========================================================================
Hearth-Pipeline        pipeline id (subject-safe token)
Hearth-Hop             the hop this frame goes *into* (0 = first shard; the orchestrator's own
                       sink is hop ``len(hops)``)
Hearth-Session         session id (one per chat request)
Hearth-Step            step number within the session, monotonic (a hop forwards its output of a
                       step under the same session and step)
Hearth-Chunk           ``i/n``: chunk ``i`` (0-based) of ``n`` chunks of this step
Hearth-Kind            ``prefill``, ``decode`` or ``reset`` (drop this session's cache; no payload)
Hearth-Pos             position of the first token of this step
Hearth-Dtype           wire dtype of the payload: ``float32``, ``bfloat16``, ``float16`` or ``int8``
Hearth-Compute-Dtype   dtype the receiver restores (``float32``, ``bfloat16``, ``float16``); absent
                       means "same as Hearth-Dtype"
Hearth-Shape           comma-separated tensor shape, e.g. ``1,600,1024``
Hearth-Offset          byte offset of this chunk's payload inside the step's wire bytes
Hearth-Bytes           size in bytes of the step's whole wire payload
Hearth-Int8-Block      elements per quantisation block (only with Hearth-Dtype ``int8``)
Hearth-Sent-Ns         ``time.time_ns()`` when the chunk was published (wire-time instrumentation;
                       only meaningful when sender and receiver share a clock)
=====================  ==========================================================================

Blockwise int8 (``Hearth-Dtype: int8``): the tensor is flattened to ``numel`` elements and cut into
``nb = ceil(numel / block)`` blocks of ``block`` consecutive elements (the last block may be short).
The step's wire bytes are ``scales: float32[nb]`` followed by ``q: int8[numel]``, where
``scale[b] = max|x| over block b / 127`` and ``q = round(x / scale[b])`` clamped to [-127, 127]
(an all-zero block has scale 0 and q 0). The receiver restores ``x ≈ q * scale[b]``; the error of
each element is at most ``scale[b] / 2``. Non-finite inputs are not representable in int8.

``float16`` on the wire saturates values beyond ±65504 (instead of producing inf, which would look
like corruption downstream). The default wire dtype is the tensor's own dtype, which is lossless.
"""

from __future__ import annotations

import enum
import math
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.transport.errors import FrameError

if sys.byteorder != "little":  # the wire is little-endian raw memory; a big-endian host would need swaps
    raise ImportError("services.transport supports little-endian hosts only")

default_chunk_bytes = 1024 * 1024
# NATS max_payload bounds headers + payload together, so a chunk leaves this much room for the headers.
header_budget_bytes = 4096
default_int8_block_elems = 64
max_tensor_dims = 8
fp16_max_abs = 65504.0
int8_max_abs = 127

SESSION_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
PIPELINE_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"

HEADER_PIPELINE = "Hearth-Pipeline"
HEADER_HOP = "Hearth-Hop"
HEADER_SESSION = "Hearth-Session"
HEADER_STEP = "Hearth-Step"
HEADER_CHUNK = "Hearth-Chunk"
HEADER_KIND = "Hearth-Kind"
HEADER_POS = "Hearth-Pos"
HEADER_DTYPE = "Hearth-Dtype"
HEADER_COMPUTE_DTYPE = "Hearth-Compute-Dtype"
HEADER_SHAPE = "Hearth-Shape"
HEADER_OFFSET = "Hearth-Offset"
HEADER_BYTES = "Hearth-Bytes"
HEADER_INT8_BLOCK = "Hearth-Int8-Block"
HEADER_SENT_NS = "Hearth-Sent-Ns"
HEADER_ACKED_NS = "Hearth-Acked-Ns"

_CHUNK_RE = re.compile(r"^(\d{1,9})/(\d{1,9})$")


class FrameKind(str, enum.Enum):
    """What a step asks of a hop."""

    prefill = "prefill"
    decode = "decode"
    reset = "reset"


class WireDtype(str, enum.Enum):
    """How tensor elements are laid out on the wire (and, minus int8, which dtypes a hop computes in)."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    int8 = "int8"

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self]

    @classmethod
    def of(cls, dtype: torch.dtype) -> "WireDtype":
        """The wire name of a compute dtype; float32, bfloat16 and float16 are supported."""
        for wire, torch_dtype in _TORCH_DTYPES.items():
            if torch_dtype == dtype and wire is not cls.int8:
                return wire
        raise ValueError(f"activation dtype {dtype} is not supported (float32, bfloat16 or float16)")


_TORCH_DTYPES: dict[WireDtype, torch.dtype] = {
    WireDtype.float32: torch.float32,
    WireDtype.bfloat16: torch.bfloat16,
    WireDtype.float16: torch.float16,
    WireDtype.int8: torch.int8,
}
_ELEMENT_BYTES = {WireDtype.float32: 4, WireDtype.bfloat16: 2, WireDtype.float16: 2}
_SETTING_ALIASES = {
    "auto": None,
    "fp32": WireDtype.float32,
    "float32": WireDtype.float32,
    "fp16": WireDtype.float16,
    "float16": WireDtype.float16,
    "bf16": WireDtype.bfloat16,
    "bfloat16": WireDtype.bfloat16,
    "int8": WireDtype.int8,
}


def wire_dtype_from_setting(setting: str) -> WireDtype | None:
    """Map the `activation_dtype` setting (auto | fp16 | fp32 | bf16 | int8) to a wire dtype; auto -> None."""
    try:
        return _SETTING_ALIASES[setting.strip().lower()]
    except KeyError:
        raise ValueError(
            f"activation_dtype {setting!r} is not one of {', '.join(sorted(_SETTING_ALIASES))}"
        ) from None


def int8_block_count(numel: int, block_elems: int) -> int:
    return -(-numel // block_elems)


def wire_nbytes(dtype: WireDtype, shape: tuple[int, ...], int8_block: int | None = None) -> int:
    """Size of a whole step's payload for this wire dtype and shape."""
    numel = math.prod(shape)
    if dtype is WireDtype.int8:
        if not int8_block:
            raise ValueError("int8 wire dtype needs a block size")
        return 4 * int8_block_count(numel, int8_block) + numel
    return _ELEMENT_BYTES[dtype] * numel


class StepInfo(BaseModel):
    """What a step is, independent of its bytes: forwarded unchanged from hop to hop."""

    model_config = ConfigDict(frozen=True)

    session: str = Field(pattern=SESSION_PATTERN)
    step: int = Field(ge=0)
    kind: FrameKind
    pos: int = Field(default=0, ge=0)


class FrameHeader(BaseModel):
    """The metadata of one activation frame (one chunk of one step); see the module docstring for headers."""

    model_config = ConfigDict(frozen=True)

    pipeline_id: str = Field(pattern=PIPELINE_ID_PATTERN)
    hop: int = Field(ge=0)
    session: str = Field(pattern=SESSION_PATTERN)
    step: int = Field(ge=0)
    kind: FrameKind
    pos: int = Field(ge=0)
    chunk_index: int = Field(ge=0)
    chunk_count: int = Field(ge=1)
    dtype: WireDtype | None = None
    compute_dtype: WireDtype | None = None
    shape: tuple[int, ...] | None = None
    offset: int = Field(default=0, ge=0)
    total_bytes: int = Field(default=0, ge=0)
    int8_block: int | None = Field(default=None, ge=1)
    sent_ns: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> "FrameHeader":
        if self.chunk_index >= self.chunk_count:
            raise ValueError(f"chunk {self.chunk_index}/{self.chunk_count}: index must be below the count")
        if self.kind is FrameKind.reset:
            if self.total_bytes or self.chunk_count != 1 or self.dtype is not None or self.shape is not None:
                raise ValueError("a reset frame is a single chunk without dtype, shape or payload")
            return self
        if self.dtype is None or self.shape is None:
            raise ValueError(f"a {self.kind.value} frame needs Hearth-Dtype and Hearth-Shape")
        if not 1 <= len(self.shape) <= max_tensor_dims or any(dim < 0 for dim in self.shape):
            raise ValueError(f"shape {self.shape}: needs 1..{max_tensor_dims} non-negative dimensions")
        if self.compute_dtype is WireDtype.int8:
            raise ValueError("compute dtype cannot be int8")
        if self.dtype is WireDtype.int8:
            if self.compute_dtype is None:
                raise ValueError("an int8 frame needs Hearth-Compute-Dtype")
            if self.int8_block is None:
                raise ValueError("an int8 frame needs Hearth-Int8-Block")
        elif self.int8_block is not None:
            raise ValueError("Hearth-Int8-Block is only allowed with Hearth-Dtype int8")
        expected = wire_nbytes(self.dtype, self.shape, self.int8_block)
        if self.total_bytes != expected:
            raise ValueError(
                f"Hearth-Bytes {self.total_bytes} does not match dtype {self.dtype.value} and shape "
                f"{self.shape} ({expected} bytes)"
            )
        if self.chunk_count > max(1, self.total_bytes):
            raise ValueError(f"{self.chunk_count} chunks for {self.total_bytes} bytes")
        if self.offset > self.total_bytes:
            raise ValueError(f"Hearth-Offset {self.offset} beyond Hearth-Bytes {self.total_bytes}")
        return self

    @property
    def info(self) -> StepInfo:
        return StepInfo.model_construct(session=self.session, step=self.step, kind=self.kind, pos=self.pos)

    @property
    def restored_dtype(self) -> WireDtype | None:
        """The dtype the receiver hands out: the compute dtype, else the wire dtype."""
        return self.compute_dtype or self.dtype

    def to_nats_headers(self) -> dict[str, str]:
        headers = _identity_headers(self)
        headers[HEADER_KIND] = self.kind.value
        headers[HEADER_POS] = str(self.pos)
        if self.dtype is not None:
            headers[HEADER_DTYPE] = self.dtype.value
        if self.compute_dtype is not None and self.compute_dtype is not self.dtype:
            headers[HEADER_COMPUTE_DTYPE] = self.compute_dtype.value
        if self.shape is not None:
            headers[HEADER_SHAPE] = ",".join(str(dim) for dim in self.shape)
        if self.kind is not FrameKind.reset:
            headers[HEADER_OFFSET] = str(self.offset)
            headers[HEADER_BYTES] = str(self.total_bytes)
        if self.int8_block is not None:
            headers[HEADER_INT8_BLOCK] = str(self.int8_block)
        if self.sent_ns is not None:
            headers[HEADER_SENT_NS] = str(self.sent_ns)
        return headers

    @classmethod
    def from_nats_headers(cls, headers: Mapping[str, str] | None) -> "FrameHeader":
        """Parse and validate a frame's headers; a FrameError names the offending header."""
        fields: dict[str, Any] = {
            **_identity_fields(headers, "frame"),
            "kind": _enum_header(headers, HEADER_KIND, FrameKind),
            "pos": _int_header(headers, HEADER_POS),
            "dtype": _enum_header(headers, HEADER_DTYPE, WireDtype, required=False),
            "compute_dtype": _enum_header(headers, HEADER_COMPUTE_DTYPE, WireDtype, required=False),
            "shape": _shape_header(headers),
            "offset": _int_header(headers, HEADER_OFFSET, required=False) or 0,
            "total_bytes": _int_header(headers, HEADER_BYTES, required=False) or 0,
            "int8_block": _int_header(headers, HEADER_INT8_BLOCK, required=False),
            "sent_ns": _int_header(headers, HEADER_SENT_NS, required=False),
        }
        if fields["compute_dtype"] is None and fields["dtype"] is not WireDtype.int8:
            fields["compute_dtype"] = fields["dtype"]
        try:
            return cls(**fields)
        except ValidationError as error:
            raise FrameError(f"bad frame headers: {_describe(error)}") from None


_FIELD_HEADERS = {
    "pipeline_id": HEADER_PIPELINE,
    "hop": HEADER_HOP,
    "session": HEADER_SESSION,
    "step": HEADER_STEP,
    "kind": HEADER_KIND,
    "pos": HEADER_POS,
    "chunk_index": HEADER_CHUNK,
    "chunk_count": HEADER_CHUNK,
    "dtype": HEADER_DTYPE,
    "compute_dtype": HEADER_COMPUTE_DTYPE,
    "shape": HEADER_SHAPE,
    "offset": HEADER_OFFSET,
    "total_bytes": HEADER_BYTES,
    "int8_block": HEADER_INT8_BLOCK,
    "sent_ns": HEADER_SENT_NS,
}


def _describe(error: ValidationError) -> str:
    parts = []
    for detail in error.errors():
        location = detail.get("loc") or ()
        name = _FIELD_HEADERS.get(str(location[0]), str(location[0])) if location else "headers"
        parts.append(f"{name}: {detail['msg']}")
    return "; ".join(parts)


def _identity_headers(message: "FrameHeader | AckHeader") -> dict[str, str]:
    """The headers a frame and its ack share: which pipeline, hop, session, step and chunk."""
    return {
        HEADER_PIPELINE: message.pipeline_id,
        HEADER_HOP: str(message.hop),
        HEADER_SESSION: message.session,
        HEADER_STEP: str(message.step),
        HEADER_CHUNK: f"{message.chunk_index}/{message.chunk_count}",
    }


def _identity_fields(headers: Mapping[str, str] | None, kind: str) -> dict[str, Any]:
    """Those shared fields parsed from a `kind` ("frame" or "ack") message's headers; FrameError names the header."""
    if not headers:
        raise FrameError(f"{kind} has no headers (expected Hearth-* headers of DESIGN.md §6)")
    chunk_text = _required(headers, HEADER_CHUNK)
    chunk_match = _CHUNK_RE.match(chunk_text)
    if not chunk_match:
        raise FrameError(f"{kind} header {HEADER_CHUNK}: expected 'i/n', got {chunk_text!r}")
    return {
        "pipeline_id": _required(headers, HEADER_PIPELINE),
        "hop": _int_header(headers, HEADER_HOP),
        "session": _required(headers, HEADER_SESSION),
        "step": _int_header(headers, HEADER_STEP),
        "chunk_index": int(chunk_match.group(1)),
        "chunk_count": int(chunk_match.group(2)),
    }


def _required(headers: Mapping[str, str], name: str) -> str:
    value = headers.get(name)
    if value is None or value == "":
        raise FrameError(f"missing header {name}")
    return value


def _int_header(headers: Mapping[str, str], name: str, *, required: bool = True) -> int | None:
    value = headers.get(name)
    if value is None or value == "":
        if required:
            raise FrameError(f"missing header {name}")
        return None
    if not value.isdigit() or len(value) > 20:
        raise FrameError(f"header {name}: expected a non-negative integer, got {value!r}")
    return int(value)


def _enum_header(headers: Mapping[str, str], name: str, enum_type: type[enum.Enum], *, required: bool = True):
    value = headers.get(name)
    if value is None or value == "":
        if required:
            raise FrameError(f"missing header {name}")
        return None
    try:
        return enum_type(value)
    except ValueError:
        allowed = ", ".join(member.value for member in enum_type)
        raise FrameError(f"header {name}: {value!r} is not one of {allowed}") from None


def _shape_header(headers: Mapping[str, str]) -> tuple[int, ...] | None:
    value = headers.get(HEADER_SHAPE)
    if value is None or value == "":
        return None
    dims = value.split(",")
    if len(dims) > max_tensor_dims or not all(dim.isdigit() and len(dim) <= 12 for dim in dims):
        raise FrameError(f"header {HEADER_SHAPE}: expected comma-separated non-negative integers, got {value!r}")
    return tuple(int(dim) for dim in dims)


def effective_chunk_bytes(requested_bytes: int | None, max_payload_bytes: int | None) -> int:
    """The chunk size to use: the request (default 1 MiB), capped so headers + payload fit max_payload."""
    chunk = default_chunk_bytes if requested_bytes is None else requested_bytes
    if chunk < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk}")
    if max_payload_bytes is not None:
        room = max_payload_bytes - header_budget_bytes
        if room < 1:
            raise ValueError(f"server max_payload {max_payload_bytes} leaves no room for frame headers")
        chunk = min(chunk, room)
    return chunk


def quantize_int8_blockwise(tensor: torch.Tensor, block_elems: int = default_int8_block_elems) -> torch.Tensor:
    """The int8 wire bytes of a tensor (float32 scales then int8 values, see module docstring), as uint8."""
    if block_elems < 1:
        raise ValueError(f"int8 block size must be positive, got {block_elems}")
    flat = tensor.detach().reshape(-1).to(torch.float32)
    numel = flat.numel()
    blocks = int8_block_count(numel, block_elems)
    padded = torch.nn.functional.pad(flat, (0, blocks * block_elems - numel)).view(blocks, block_elems)
    scales = padded.abs().amax(dim=1) / int8_max_abs
    safe_scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    quantized = torch.round(padded / safe_scales[:, None]).clamp_(-int8_max_abs, int8_max_abs).to(torch.int8)
    return torch.cat((scales.view(torch.uint8), quantized.reshape(-1)[:numel].view(torch.uint8)))


def dequantize_int8_blockwise(
    payload: torch.Tensor, shape: tuple[int, ...], block_elems: int, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of quantize_int8_blockwise: a tensor of `shape` and `dtype` from the uint8 wire bytes."""
    numel = math.prod(shape)
    blocks = int8_block_count(numel, block_elems)
    scales = payload[: 4 * blocks].view(torch.float32)
    quantized = payload[4 * blocks : 4 * blocks + numel].view(torch.int8).to(torch.float32)
    padded = torch.nn.functional.pad(quantized, (0, blocks * block_elems - numel)).view(blocks, block_elems)
    return (padded * scales[:, None]).reshape(-1)[:numel].view(shape).to(dtype)


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
        # (Run once per step on every hop, with caches cold after the layers: validation costs ~30 us there.)
        return FrameHeader.model_construct(
            pipeline_id=pipeline_id,
            hop=hop,
            session=self.info.session,
            step=self.info.step,
            kind=self.info.kind,
            pos=self.info.pos,
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


# Dtypes whose CPU tensors .numpy() can view without a copy.
numpy_viewable_dtypes = (torch.float32, torch.float16, torch.uint8, torch.int8)


def encode_step(
    info: StepInfo,
    tensor: torch.Tensor | None,
    *,
    wire_dtype: WireDtype | None = None,
    chunk_bytes: int = default_chunk_bytes,
    int8_block: int = default_int8_block_elems,
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
    if tensor.dim() < 1 or tensor.dim() > max_tensor_dims:
        raise ValueError(f"activation tensors need 1..{max_tensor_dims} dimensions, got shape {tuple(tensor.shape)}")
    compute = WireDtype.of(tensor.dtype)
    wire = wire_dtype or compute
    source = tensor.detach() if tensor.requires_grad else tensor
    if source.device.type != "cpu":
        source = source.cpu()
    block: int | None = None
    if wire is WireDtype.int8:
        block = int8_block
        payload = quantize_int8_blockwise(source, int8_block)
    else:
        if wire is WireDtype.float16 and compute is not WireDtype.float16:
            source = source.clamp(-fp16_max_abs, fp16_max_abs)
        payload = source.to(wire.torch_dtype) if wire is not compute else source
        payload = payload if payload.is_contiguous() else payload.contiguous()
    if payload.numel() == 0:
        view = memoryview(b"")
    elif payload.dtype in numpy_viewable_dtypes:
        # The cheap way to the bytes: no torch dispatch besides contiguous() (this runs once per step on every
        # hop right after its layers evicted the caches, where each torch call costs ~30-60 us).
        view = memoryview(payload.numpy()).cast("B")
    else:  # bfloat16 has no numpy dtype: reinterpret as bytes first
        view = memoryview(payload.reshape(-1).view(torch.uint8).numpy())
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
            or header.dtype is not first.dtype
            or header.compute_dtype is not first.compute_dtype
            or header.shape != first.shape
            or header.total_bytes != first.total_bytes
            or header.int8_block != first.int8_block
        ):
            raise FrameError(
                f"chunk {header.chunk_index}/{header.chunk_count} of step {header.step} (session "
                f"{header.session}) disagrees with the step's first chunk on kind/pos/dtype/shape/size"
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
        return decode_payload(self.header, self.buffer if self.buffer is not None else bytearray())


def decode_payload(header: FrameHeader, buffer: bytearray) -> torch.Tensor | None:
    """The tensor a step's complete wire bytes describe, in the compute dtype; shares `buffer` when it can."""
    if header.kind is FrameKind.reset or header.dtype is None or header.shape is None:
        return None
    restored = (header.restored_dtype or header.dtype).torch_dtype
    if header.total_bytes == 0:
        return torch.empty(header.shape, dtype=restored)
    if header.dtype is WireDtype.int8:
        raw = torch.frombuffer(buffer, dtype=torch.uint8)
        return dequantize_int8_blockwise(raw, header.shape, header.int8_block or 1, restored)
    tensor = torch.frombuffer(buffer, dtype=header.dtype.torch_dtype).view(header.shape)
    return tensor if tensor.dtype == restored else tensor.to(restored)


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


class AckHeader(BaseModel):
    """An ack: an empty-payload message on ``hearth.ack.<pipeline_id>.<hop>`` saying "hop `hop` holds chunk
    `chunk_index`/`chunk_count` of (session, step)".

    Headers: Hearth-Pipeline, Hearth-Hop (the hop that acks, i.e. the receiver), Hearth-Session,
    Hearth-Step, Hearth-Chunk (``i/n``) and Hearth-Acked-Ns (``time.time_ns()`` at the receiver). A
    receiver acks a chunk once it has placed it (or knows it as a duplicate or stale chunk); the chunk
    that completes a step is acked once the step has been queued for the hop's consumer, so a consumer
    that stops taking steps stops the acks, and the sender's window turns that into backpressure.
    The sender frees its window on acks; the orchestrator watches ``hearth.ack.<pipeline_id>.*`` to see
    which hop last took each step (AckObserver).
    """

    model_config = ConfigDict(frozen=True)

    pipeline_id: str = Field(pattern=PIPELINE_ID_PATTERN)
    hop: int = Field(ge=0)
    session: str = Field(pattern=SESSION_PATTERN)
    step: int = Field(ge=0)
    chunk_index: int = Field(ge=0)
    chunk_count: int = Field(ge=1)
    acked_ns: int | None = Field(default=None, ge=0)

    @classmethod
    def for_frame(cls, frame: FrameHeader, *, acked_ns: int | None = None) -> "AckHeader":
        return cls.model_construct(
            pipeline_id=frame.pipeline_id,
            hop=frame.hop,
            session=frame.session,
            step=frame.step,
            chunk_index=frame.chunk_index,
            chunk_count=frame.chunk_count,
            acked_ns=acked_ns,
        )

    def to_nats_headers(self) -> dict[str, str]:
        headers = _identity_headers(self)
        if self.acked_ns is not None:
            headers[HEADER_ACKED_NS] = str(self.acked_ns)
        return headers

    @classmethod
    def from_nats_headers(cls, headers: Mapping[str, str] | None) -> "AckHeader":
        fields = _identity_fields(headers, "ack")
        chunk_index, chunk_count = fields["chunk_index"], fields["chunk_count"]
        if chunk_index >= chunk_count:
            raise FrameError(f"ack header {HEADER_CHUNK}: index {chunk_index} must be below count {chunk_count}")
        try:
            return cls(**fields, acked_ns=_int_header(headers, HEADER_ACKED_NS, required=False))
        except ValidationError as error:
            raise FrameError(f"bad ack headers: {_describe(error)}") from None
