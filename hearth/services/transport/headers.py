"""The NATS header codec of docs/protocol.md: FrameHeader and AckHeader <-> ``Hearth-*`` headers, validated on
the way in.

One frame is one core-NATS message on ``hearth.act.<receiving node>.<pipeline_id>.<hop>``. Its headers carry the
metadata below; its payload is a slice of the step's wire bytes (services.transport.wire), cut and put
back together by services.transport.frames.

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
Hearth-Kind            ``prefill``, ``decode``, ``replay`` (tokens the session decoded, prefilled again after
                       a failover, each attending as its decode step did) or ``reset`` (drop this
                       session's cache; no payload)
Hearth-Pos             position of the first token of this step
Hearth-Prompt-Tokens   on a ``prefill`` step: how many tokens the prompt it is a chunk of has (its
                       positions rotate as the whole prompt's; LongRoPE picks its factors by that
                       length); absent means the step's own end
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

An ack is an empty-payload message on ``hearth.ack.<sending node>.<pipeline_id>.<hop>`` (see AckHeader).

Every header above is bounded by its own form; all the headers of one frame or ack together are at most
``max_header_bytes``, checked before anything else is read (or a MAC computed) over them.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hearth.protocol.bounds import max_int8_block_elems
from hearth.services.transport.errors import FrameError
from hearth.services.transport.wire import WireDtype, max_shape_extent, max_tensor_dims, wire_nbytes

SESSION_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
PIPELINE_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"

HEADER_PIPELINE = "Hearth-Pipeline"
HEADER_HOP = "Hearth-Hop"
HEADER_SESSION = "Hearth-Session"
HEADER_STEP = "Hearth-Step"
HEADER_CHUNK = "Hearth-Chunk"
HEADER_KIND = "Hearth-Kind"
HEADER_POS = "Hearth-Pos"
HEADER_PROMPT_TOKENS = "Hearth-Prompt-Tokens"
HEADER_DTYPE = "Hearth-Dtype"
HEADER_COMPUTE_DTYPE = "Hearth-Compute-Dtype"
HEADER_SHAPE = "Hearth-Shape"
HEADER_OFFSET = "Hearth-Offset"
HEADER_BYTES = "Hearth-Bytes"
HEADER_INT8_BLOCK = "Hearth-Int8-Block"
HEADER_SENT_NS = "Hearth-Sent-Ns"
HEADER_ACKED_NS = "Hearth-Acked-Ns"

_CHUNK_RE = re.compile(r"^(\d{1,9})/(\d{1,9})$")
# The most header bytes (names and values) one frame or ack may carry: ours carry a few hundred, and a chunk
# leaves this much of the server's max_payload for them (hearth/services/transport/frames.py).
max_header_bytes = 4096


def header_bytes(headers: Mapping[str, str] | None) -> int:
    """The size of a message's headers, every name and value, as nats-server's max_payload counts them too (here
    against max_header_bytes, and the orchestrator's requests against max_request_header_bytes)."""
    return sum(len(name) + len(value) for name, value in (headers or {}).items())


def oversized_headers(headers: Mapping[str, str] | None) -> bool:
    return headers is not None and header_bytes(headers) > max_header_bytes


class FrameKind(str, enum.Enum):
    """What a step asks of a hop."""

    prefill = "prefill"
    decode = "decode"
    # Tokens the session decoded one by one, prefilled again (a re-prefill after a failover): each query attends as
    # its decode step did, so the hop rebuilds the very cache and outputs (hearth/inference/row_attention.py).
    replay = "replay"
    reset = "reset"


class StepInfo(BaseModel):
    """What a step is, independent of its bytes: forwarded unchanged from hop to hop."""

    model_config = ConfigDict(frozen=True)

    session: str = Field(pattern=SESSION_PATTERN)
    step: int = Field(ge=0)
    kind: FrameKind
    pos: int = Field(default=0, ge=0)
    prompt_tokens: int | None = Field(default=None, ge=1)


class FrameHeader(BaseModel):
    """The metadata of one activation frame (one chunk of one step); see the module docstring for headers."""

    model_config = ConfigDict(frozen=True)

    pipeline_id: str = Field(pattern=PIPELINE_ID_PATTERN)
    hop: int = Field(ge=0)
    session: str = Field(pattern=SESSION_PATTERN)
    step: int = Field(ge=0)
    kind: FrameKind
    pos: int = Field(ge=0)
    prompt_tokens: int | None = Field(default=None, ge=1)
    chunk_index: int = Field(ge=0)
    chunk_count: int = Field(ge=1)
    dtype: WireDtype | None = None
    compute_dtype: WireDtype | None = None
    shape: tuple[int, ...] | None = None
    offset: int = Field(default=0, ge=0)
    total_bytes: int = Field(default=0, ge=0)
    int8_block: int | None = Field(default=None, ge=1, le=max_int8_block_elems)
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
        if self.prompt_tokens is not None and self.kind is not FrameKind.prefill:
            raise ValueError(f"Hearth-Prompt-Tokens is only allowed on a prefill frame, not {self.kind.value}")
        if not 1 <= len(self.shape) <= max_tensor_dims or any(dim < 0 for dim in self.shape):
            raise ValueError(f"shape {self.shape}: needs 1..{max_tensor_dims} non-negative dimensions")
        if math.prod(max(dim, 1) for dim in self.shape) > max_shape_extent:
            raise ValueError(f"shape {self.shape}: no tensor has dimensions that span more than {max_shape_extent}")
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
        return StepInfo.model_construct(session=self.session, step=self.step, kind=self.kind, pos=self.pos,
                                        prompt_tokens=self.prompt_tokens)

    @property
    def restored_dtype(self) -> WireDtype | None:
        """The dtype the receiver hands out: the compute dtype, else the wire dtype."""
        return self.compute_dtype or self.dtype

    def to_nats_headers(self) -> dict[str, str]:
        headers = _identity_headers(self)
        headers[HEADER_KIND] = self.kind.value
        headers[HEADER_POS] = str(self.pos)
        if self.prompt_tokens is not None:
            headers[HEADER_PROMPT_TOKENS] = str(self.prompt_tokens)
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
            "prompt_tokens": _int_header(headers, HEADER_PROMPT_TOKENS, required=False),
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
    "prompt_tokens": HEADER_PROMPT_TOKENS,
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
        raise FrameError(f"{kind} has no headers (expected Hearth-* headers of docs/protocol.md)")
    if oversized_headers(headers):
        raise FrameError(f"{kind} headers: {header_bytes(headers)} bytes, over {max_header_bytes}")
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
    if not (value.isascii() and value.isdigit()) or len(value) > 20:
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
    if len(dims) > max_tensor_dims or not all(dim.isascii() and dim.isdigit() and len(dim) <= 12 for dim in dims):
        raise FrameError(f"header {HEADER_SHAPE}: expected comma-separated non-negative integers, got {value!r}")
    return tuple(int(dim) for dim in dims)


class AckHeader(BaseModel):
    """An ack: an empty-payload message on ``hearth.ack.<sending node>.<pipeline_id>.<hop>`` saying "hop `hop`
    holds chunk `chunk_index`/`chunk_count` of (session, step)".

    Headers: Hearth-Pipeline, Hearth-Hop (the hop that acks, i.e. the receiver), Hearth-Session,
    Hearth-Step, Hearth-Chunk (``i/n``) and Hearth-Acked-Ns (``time.time_ns()`` at the receiver). A
    receiver acks a chunk once it has placed it (or knows it as a duplicate; never a stale step's); the chunk
    that completes a step is acked once the step has been queued for the hop's consumer, so a consumer
    that stops taking steps stops the acks, and the sender's window turns that into backpressure.
    The sender frees its window on acks; the orchestrator watches ``hearth.ack.*.<pipeline_id>.*`` to see
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
