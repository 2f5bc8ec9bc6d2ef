"""Activation frames without a network: header mapping and validation, chunking, dtype round trips."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hearth.services.transport.errors import FrameError
from hearth.services.common.config import TransportSettings
from hearth.services.transport.frames import (
    AddOutcome,
    StepAssembler,
    decode_frames,
    effective_chunk_bytes,
    encode_step,
    header_budget_bytes,
)
from hearth.services.transport.headers import (
    HEADER_BYTES,
    HEADER_CHUNK,
    HEADER_COMPUTE_DTYPE,
    HEADER_DTYPE,
    HEADER_INT8_BLOCK,
    HEADER_KIND,
    HEADER_SESSION,
    HEADER_SHAPE,
    HEADER_STEP,
    AckHeader,
    FrameHeader,
    FrameKind,
    StepInfo,
)
from hearth.services.transport.wire import WireDtype, wire_dtype_from_setting

PIPELINE = "pipe-1"
PREFILL = StepInfo(session="sess-1", step=3, kind=FrameKind.prefill, pos=0)


def frames_of(info: StepInfo, tensor, **options):
    """Encode, then pass every chunk through its NATS header dict, as a receiver would see it."""
    encoded = encode_step(info, tensor, **options)
    return [
        (FrameHeader.from_nats_headers(encoded.header(PIPELINE, 1, index, sent_ns=123).to_nats_headers()), bytes(chunk))
        for index, chunk in enumerate(encoded.chunks)
    ]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """Reinterpret as integers so NaN payloads and -0.0 compare bit for bit."""
    return tensor.view({4: torch.int32, 2: torch.int16}[tensor.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lossless_round_trip_is_bitwise_in_any_chunk_order(dtype):
    tensor = torch.randn(2, 37, 24).to(dtype)
    tensor[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, float("-inf")]).to(dtype)
    frames = frames_of(PREFILL, tensor, chunk_bytes=500)
    assert len(frames) > 3
    random.Random(7).shuffle(frames)

    info, restored = decode_frames(frames)

    assert info == PREFILL
    assert restored.dtype == dtype and restored.shape == tensor.shape
    assert torch.equal(bits(restored), bits(tensor))


def test_default_wire_dtype_is_the_tensor_dtype():
    frames = frames_of(PREFILL, torch.randn(3, 8).to(torch.bfloat16))
    header = frames[0][0]
    assert header.dtype is WireDtype.bfloat16 and header.compute_dtype is WireDtype.bfloat16
    assert header.total_bytes == 3 * 8 * 2


def test_bf16_over_fp32_wire_is_lossless_and_restores_bf16():
    tensor = torch.randn(4, 16).to(torch.bfloat16)
    frames = frames_of(PREFILL, tensor, wire_dtype=WireDtype.float32)
    assert frames[0][0].dtype is WireDtype.float32 and frames[0][0].total_bytes == 4 * 16 * 4
    _, restored = decode_frames(frames)
    assert restored.dtype == torch.bfloat16 and torch.equal(restored, tensor)


def test_fp16_wire_rounds_within_half_precision_and_saturates_instead_of_inf():
    tensor = torch.randn(8, 64) * 10
    tensor[0, 0], tensor[0, 1] = 1e6, -1e6
    _, restored = decode_frames(frames_of(PREFILL, tensor, wire_dtype=WireDtype.float16))
    assert restored.dtype == torch.float32
    assert torch.isfinite(restored).all()
    assert restored[0, 0] == 65504.0 and restored[0, 1] == -65504.0
    body = slice(1, None)
    assert torch.allclose(restored[body], tensor[body], rtol=2 ** -10, atol=1e-6)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [64, 50])
def test_int8_blockwise_error_is_within_half_a_step_of_each_block(compute_dtype, block):
    tensor = (torch.randn(3, 333) * torch.linspace(0.01, 50, 333)).to(compute_dtype)
    tensor[1] = 0.0  # all-zero blocks must come back as exact zeros
    frames = frames_of(PREFILL, tensor, wire_dtype=WireDtype.int8, int8_block=block, chunk_bytes=256)
    header = frames[0][0]
    numel = tensor.numel()
    blocks = -(-numel // block)
    assert header.dtype is WireDtype.int8 and header.int8_block == block
    assert header.total_bytes == 4 * blocks + numel
    random.Random(1).shuffle(frames)

    _, restored = decode_frames(frames)

    assert restored.dtype == compute_dtype and restored.shape == tensor.shape
    assert torch.equal(restored[1], tensor[1])
    flat = tensor.reshape(-1).float()
    padded = torch.nn.functional.pad(flat, (0, blocks * block - numel)).view(blocks, block)
    half_step = (padded.abs().amax(dim=1) / 127 / 2).repeat_interleave(block)[:numel]
    # bf16 restoration adds its own rounding (8 bits of mantissa) on top of the int8 step.
    slack = flat.abs() * (2 ** -8 if compute_dtype == torch.bfloat16 else 1e-6) + 1e-7
    assert ((restored.reshape(-1).float() - flat).abs() <= half_step + slack).all()


@pytest.mark.parametrize(
    ("numel", "chunk_bytes", "expected_sizes"),
    [
        (256, 256, [256, 256, 256, 256]),  # 1024 bytes: exactly four full chunks
        (257, 256, [256, 256, 256, 256, 4]),  # one element over: a short fifth chunk
        (10, 1000, [40]),  # smaller than one chunk
        (1, 1, [1, 1, 1, 1]),  # one byte per chunk
    ],
)
def test_chunks_cut_exactly_at_chunk_bytes(numel, chunk_bytes, expected_sizes):
    tensor = torch.arange(numel, dtype=torch.float32)
    encoded = encode_step(PREFILL, tensor, chunk_bytes=chunk_bytes)
    assert [len(chunk) for chunk in encoded.chunks] == expected_sizes
    assert list(encoded.offsets) == [chunk_bytes * index for index in range(len(expected_sizes))]
    assert torch.equal(decode_frames(frames_of(PREFILL, tensor, chunk_bytes=chunk_bytes))[1], tensor)


def test_empty_tensor_is_one_empty_chunk():
    frames = frames_of(PREFILL, torch.empty(1, 0, 8))
    assert len(frames) == 1 and frames[0][1] == b""
    _, restored = decode_frames(frames)
    assert restored.shape == (1, 0, 8)


def test_same_dtype_chunks_view_the_tensor_memory_without_copying():
    tensor = torch.zeros(4, 4)
    encoded = encode_step(PREFILL, tensor)
    tensor[0, 0] = 1.0
    assert bytes(encoded.chunks[0][:4]) == torch.tensor([1.0]).numpy().tobytes()


def test_reset_step_has_no_payload_and_decodes_to_none():
    info = StepInfo(session="sess-1", step=9, kind=FrameKind.reset)
    frames = frames_of(info, None)
    assert len(frames) == 1 and frames[0][1] == b""
    assert HEADER_DTYPE not in frames[0][0].to_nats_headers()
    assert decode_frames(frames) == (info, None)


def test_chunk_size_never_exceeds_server_max_payload():
    assert effective_chunk_bytes(None, None) == TransportSettings().chunk_bytes == 1024 * 1024
    assert effective_chunk_bytes(None, 8 * 1024 * 1024) == 1024 * 1024
    assert effective_chunk_bytes(None, 64 * 1024) == 64 * 1024 - header_budget_bytes
    with pytest.raises(ValueError, match="positive"):
        effective_chunk_bytes(0, None)


def test_header_mapping_round_trips_and_uses_documented_names():
    encoded = encode_step(PREFILL, torch.randn(1, 5, 6).to(torch.bfloat16), wire_dtype=WireDtype.int8)
    header = encoded.header(PIPELINE, 2, 0, sent_ns=42)
    headers = header.to_nats_headers()
    assert headers[HEADER_SESSION] == "sess-1"
    assert headers[HEADER_STEP] == "3"
    assert headers[HEADER_CHUNK] == "0/1"
    assert headers[HEADER_KIND] == "prefill"
    assert headers[HEADER_SHAPE] == "1,5,6"
    assert headers[HEADER_DTYPE] == "int8" and headers[HEADER_COMPUTE_DTYPE] == "bfloat16"
    assert headers["Hearth-Pos"] == "0" and headers["Hearth-Sent-Ns"] == "42" and headers["Hearth-Hop"] == "2"
    assert FrameHeader.from_nats_headers(headers) == header
    assert FrameHeader.from_nats_headers({**headers, HEADER_KIND: "replay"}).kind is FrameKind.replay
    assert "Hearth-Prompt-Tokens" not in headers and header.info.prompt_tokens is None

    chunk = encode_step(PREFILL.model_copy(update={"pos": 5, "prompt_tokens": 40}), torch.randn(1, 5, 6))
    chunk_headers = chunk.header(PIPELINE, 0, 0).to_nats_headers()
    assert chunk_headers["Hearth-Prompt-Tokens"] == "40"
    assert FrameHeader.from_nats_headers(chunk_headers).info == chunk.info  # forwarded hop to hop as it came


def good_headers() -> dict[str, str]:
    return encode_step(PREFILL, torch.randn(2, 4)).header(PIPELINE, 0, 0).to_nats_headers()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({HEADER_STEP: None}, "missing header Hearth-Step"),
        ({HEADER_STEP: "abc"}, "Hearth-Step: expected a non-negative integer"),
        ({HEADER_STEP: "-1"}, "Hearth-Step: expected a non-negative integer"),
        ({HEADER_STEP: "\u00b2"}, "Hearth-Step: expected a non-negative integer"),  # a digit int() does not read
        ({"Hearth-Prompt-Tokens": "\u0663"}, "Hearth-Prompt-Tokens: expected a non-negative integer"),
        ({HEADER_SHAPE: "2,\u00b2"}, "Hearth-Shape: expected comma-separated"),
        ({HEADER_CHUNK: "1"}, "Hearth-Chunk: expected 'i/n'"),
        ({HEADER_CHUNK: "1/1"}, "index must be below the count"),
        ({HEADER_KIND: "embed"}, "Hearth-Kind: 'embed' is not one of prefill, decode, replay, reset"),
        ({HEADER_DTYPE: "float64"}, "Hearth-Dtype: 'float64' is not one of"),
        ({HEADER_DTYPE: None}, "needs Hearth-Dtype and Hearth-Shape"),
        ({HEADER_SHAPE: "2,x"}, "Hearth-Shape: expected comma-separated"),
        ({HEADER_SHAPE: "2,4,1,1,1,1,1,1,1"}, "Hearth-Shape"),
        ({HEADER_BYTES: "31"}, "Hearth-Bytes 31 does not match"),
        ({HEADER_SESSION: "has space"}, "Hearth-Session"),
        ({"Hearth-Pipeline": "a.b"}, "Hearth-Pipeline"),
        ({HEADER_INT8_BLOCK: "64"}, "only allowed with Hearth-Dtype int8"),
        ({HEADER_DTYPE: "int8", HEADER_BYTES: "12"}, "Hearth-Compute-Dtype"),
        ({HEADER_KIND: "reset"}, "a reset frame is a single chunk without dtype"),
        ({"Hearth-Prompt-Tokens": "0"}, "Hearth-Prompt-Tokens"),
        ({"Hearth-Prompt-Tokens": "9", HEADER_KIND: "decode"}, "only allowed on a prefill frame, not decode"),
    ],
)
def test_bad_headers_are_rejected_with_the_header_named(change, message):
    headers = good_headers()
    for name, value in change.items():
        if value is None:
            headers.pop(name)
        else:
            headers[name] = value
    with pytest.raises(FrameError, match=message):
        FrameHeader.from_nats_headers(headers)


def test_frame_without_headers_is_rejected():
    with pytest.raises(FrameError, match="no headers"):
        FrameHeader.from_nats_headers(None)


def test_assembler_counts_duplicates_and_refuses_overflow_and_disagreeing_chunks():
    frames = frames_of(PREFILL, torch.randn(64), chunk_bytes=100)
    first_header, first_payload = frames[0]
    assembler = StepAssembler(first_header)
    assert assembler.add(first_header, first_payload) is AddOutcome.added
    assert assembler.add(first_header, first_payload) is AddOutcome.duplicate
    last_header, _ = frames[-1]
    with pytest.raises(FrameError, match="overflows Hearth-Bytes"):
        assembler.add(last_header, b"\0" * 100)
    other_shape = FrameHeader.from_nats_headers(
        frames_of(PREFILL, torch.randn(2, 32), chunk_bytes=100)[1][0].to_nats_headers()
    )
    with pytest.raises(FrameError, match="disagrees"):
        assembler.add(other_shape, frames[1][1])
    for header, payload in frames[1:]:
        outcome = assembler.add(header, payload)
    assert outcome is AddOutcome.complete


def test_decode_frames_names_missing_chunks():
    frames = frames_of(PREFILL, torch.randn(64), chunk_bytes=100)
    with pytest.raises(FrameError, match=r"missing chunks \[1\]"):
        decode_frames([frames[0], *frames[2:]])


def test_encode_refuses_unsupported_tensors():
    with pytest.raises(ValueError, match="not supported"):
        encode_step(PREFILL, torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="dimensions"):
        encode_step(PREFILL, torch.tensor(1.0))
    with pytest.raises(TypeError, match="needs a torch.Tensor"):
        encode_step(PREFILL, None)
    with pytest.raises(ValueError, match="carries no tensor"):
        encode_step(StepInfo(session="s", step=0, kind=FrameKind.reset), torch.zeros(1))


def test_ack_header_round_trip_and_validation():
    frame = frames_of(PREFILL, torch.randn(64), chunk_bytes=100)[1][0]
    ack = AckHeader.for_frame(frame, acked_ns=7)
    headers = ack.to_nats_headers()
    assert headers == {
        "Hearth-Pipeline": PIPELINE, "Hearth-Hop": "1", "Hearth-Session": "sess-1", "Hearth-Step": "3",
        "Hearth-Chunk": "1/3", "Hearth-Acked-Ns": "7",
    }
    assert AckHeader.from_nats_headers(headers) == ack
    with pytest.raises(FrameError, match="Hearth-Hop"):
        AckHeader.from_nats_headers({**headers, "Hearth-Hop": "one"})
    with pytest.raises(FrameError, match="below count"):
        AckHeader.from_nats_headers({**headers, "Hearth-Chunk": "3/3"})


def test_activation_dtype_setting_maps_to_wire_dtype():
    assert wire_dtype_from_setting("auto") is None
    assert wire_dtype_from_setting("fp16") is WireDtype.float16
    assert wire_dtype_from_setting("FP32") is WireDtype.float32
    assert wire_dtype_from_setting("int8") is WireDtype.int8
    with pytest.raises(ValueError, match="activation_dtype 'int4'"):
        wire_dtype_from_setting("int4")


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=4),
    chunk_bytes=st.integers(min_value=1, max_value=300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_any_shape_and_chunk_size_round_trips_bitwise(shape, chunk_bytes, dtype, seed):
    tensor = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    frames = frames_of(PREFILL, tensor, chunk_bytes=chunk_bytes)
    assert all(len(payload) <= chunk_bytes for _, payload in frames)
    random.Random(seed).shuffle(frames)
    assert torch.equal(bits(decode_frames(frames)[1]), bits(tensor))
