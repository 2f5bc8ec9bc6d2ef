"""StepLimits: a step whose declared shape, positions, wire dtype or chunk count does not fit its pipeline is refused
from its headers alone; every step an honest sender of the pipeline makes fits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hearth.services.common.config import smallest_chunk_bytes
from hearth.services.transport import FrameHeader, FrameKind, StepInfo, StepLimits, encode_step
from hearth.services.transport.wire import WireDtype, wire_dtype_from_setting, wire_nbytes

PIPELINE = "pipe-limits"
HIDDEN = 64
MAX_TOKENS = 300
LIMITS = StepLimits.for_pipeline(hidden_size=HIDDEN, max_tokens=MAX_TOKENS)


def header(shape, *, dtype=WireDtype.float32, pos=0, chunk_count=1, kind=FrameKind.prefill, block=None,
           compute=None, prompt_tokens=None) -> FrameHeader:
    total = wire_nbytes(dtype, shape, block)
    return FrameHeader(pipeline_id=PIPELINE, hop=1, session="s", step=1, kind=kind, pos=pos, chunk_index=0,
                       chunk_count=chunk_count, dtype=dtype, compute_dtype=compute or dtype, shape=shape,
                       total_bytes=total, int8_block=block, prompt_tokens=prompt_tokens)


@pytest.mark.parametrize("forged, reason", [
    (header((1, 0, HIDDEN)), "shape"),  # an empty tensor
    (header((1, 5, HIDDEN - 1)), "shape"),  # another hidden size
    (header((2, 5, HIDDEN)), "shape"),
    (header((5 * HIDDEN,)), "shape"),
    (header((1, 1, 1, HIDDEN)), "shape"),
    (header((1, MAX_TOKENS + 1, HIDDEN)), "positions"),
    (header((1, 1, HIDDEN), pos=MAX_TOKENS, kind=FrameKind.decode), "positions"),
    (header((1, 2_000_000, HIDDEN)), "positions"),  # 512 MB claimed
    (header((1, 8, HIDDEN), pos=4, prompt_tokens=11), "positions"),  # a chunk reaching past its prompt
    (header((1, 8, HIDDEN), prompt_tokens=MAX_TOKENS + 1), "positions"),  # a prompt beyond the session
    (header((1, 4, HIDDEN), dtype=WireDtype.int8, block=64, compute=WireDtype.float32), "dtype"),
    (header((1, 4, HIDDEN), chunk_count=1000), "chunks"),  # 1 KiB claimed in 1000 chunks
    # A "decode" of many tokens ran whole on the compute thread, holding every other session for its length.
    (header((1, 2, HIDDEN), kind=FrameKind.decode), "shape"),
    (header((1, MAX_TOKENS, HIDDEN), kind=FrameKind.decode), "shape"),
])
def test_a_step_that_does_not_fit_the_pipeline_is_refused_with_its_reason(forged, reason):
    refusal = LIMITS.refusal(forged)
    assert refusal is not None and refusal.reason == reason, refusal


def test_the_wire_dtype_follows_the_activation_dtype_setting():
    fp16 = StepLimits.for_pipeline(hidden_size=HIDDEN, max_tokens=MAX_TOKENS, activation_dtype="fp16")
    assert fp16.refusal(header((1, 3, HIDDEN), dtype=WireDtype.float16)) is None
    assert fp16.refusal(header((1, 3, HIDDEN))).reason == "dtype"
    int8 = StepLimits.for_pipeline(hidden_size=HIDDEN, max_tokens=MAX_TOKENS, activation_dtype="int8")
    assert int8.refusal(header((1, 3, HIDDEN), dtype=WireDtype.int8, block=64, compute=WireDtype.bfloat16)) is None
    assert all(LIMITS.refusal(header((1, 3, HIDDEN), dtype=dtype)) is None
               for dtype in (WireDtype.float32, WireDtype.bfloat16, WireDtype.float16))


def test_a_decode_step_of_one_token_and_replays_of_many_fit():
    assert LIMITS.refusal(header((1, 1, HIDDEN), pos=MAX_TOKENS - 1, kind=FrameKind.decode)) is None
    assert LIMITS.refusal(header((1, 40, HIDDEN), pos=10, kind=FrameKind.replay)) is None


def test_a_reset_needs_no_shape():
    reset = FrameHeader(pipeline_id=PIPELINE, hop=1, session="s", step=2, kind=FrameKind.reset, pos=0,
                        chunk_index=0, chunk_count=1)
    assert LIMITS.refusal(reset) is None


@given(tokens=st.integers(1, MAX_TOKENS), chunk_bytes=st.integers(smallest_chunk_bytes, 64 * 1024),
       setting=st.sampled_from(["auto", "fp16", "fp32", "int8"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_every_step_an_honest_sender_makes_fits(tokens, chunk_bytes, setting, dtype):
    pos = MAX_TOKENS - tokens
    encoded = encode_step(StepInfo(session="s", step=1, kind=FrameKind.prefill, pos=pos),
                          torch.zeros(1, tokens, HIDDEN, dtype=dtype), wire_dtype=wire_dtype_from_setting(setting),
                          chunk_bytes=chunk_bytes)
    limits = StepLimits.for_pipeline(hidden_size=HIDDEN, max_tokens=MAX_TOKENS, activation_dtype=setting)
    for index in range(encoded.chunk_count):
        parsed = FrameHeader.from_nats_headers(encoded.header(PIPELINE, 1, index).to_nats_headers())
        assert limits.refusal(parsed) is None
        assert parsed.total_bytes <= limits.max_step_bytes
