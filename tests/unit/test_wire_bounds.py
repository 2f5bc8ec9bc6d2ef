"""Bounds and authentication at each wire's boundary: hop notices are read only with the MAC of the hop they
name; frame, ack and notice headers, the MAC header itself and the shard control messages all have size bounds
checked before anything else is done with them; a hop's unverified report blames nobody."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from sqlalchemy.orm import Session

from hearth.events.models import UNVERIFIED_REPORT, PipelineFailover
from hearth.readmodels.tables import ShardStats
from hearth.protocol.control import ControlReply, HopNotice, OpenHop, ShardStat, max_open_pipelines, reply_says_ok
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.transport import AckHeader, FrameError, FrameHeader, FrameKind
from hearth.services.transport.headers import max_header_bytes
from hearth.services.transport.mac import HEADER_MAC, mac_is_valid, new_link_key, with_mac
from hearth.services.transport.notices import max_notice_bytes, notice_message, read_notice
from hearth.protocol.bounds import max_int8_block_elems
from hearth.services.transport.wire import (
    WireDtype,
    dequantize_int8_blockwise,
    quantize_int8_blockwise,
    wire_nbytes,
)
from tests.readmodel_helpers import LogBuilder, apply_all, at, constructed, migrated_engine

PIPELINE, SESSION = "p-notices", "s1"


def notice(hop: int, problem: str = "step_failed", **fields) -> HopNotice:
    return HopNotice(pipeline_id=PIPELINE, session_id=SESSION, hop=hop, step=3, problem=problem, **fields)


def read(payload: bytes, headers, keys) -> object:
    return read_notice(payload, headers, pipeline_id=PIPELINE, session_id=SESSION, notice_keys=keys)


def test_a_notice_is_read_only_with_the_mac_of_the_hop_it_names():
    keys = [new_link_key() for _ in range(3)]
    payload, headers = notice_message(notice(1), keys[1])
    assert read(payload, headers, keys) == notice(1)
    # Hop 1 speaking for hop 2 (blaming it), or for hop 0 with an accusation: its key is not theirs.
    for forged in (notice(2), notice(1, "input_failed_check", check="nan").model_copy(update={"hop": 0})):
        assert read(*notice_message(forged, keys[1]), keys) == "mac"
    assert read(payload, None, keys) == "mac"  # no MAC at all (a shard of before notice keys, or a forger)
    assert read(*notice_message(notice(7), keys[1]), keys) == "mac"  # a hop the pipeline does not have
    # The same notice with a field changed after it was MACed.
    assert read(payload.replace(b'"step":3', b'"step":4'), headers, keys) == "mac"


def test_notices_of_other_sessions_are_ignored_and_malformed_ones_refused():
    keys = [new_link_key()]
    other = notice(0).model_copy(update={"session_id": "s0"})
    assert read(*notice_message(other, keys[0]), keys) is None
    assert read(b"not json", None, keys) == "malformed"
    assert read(b" " * (max_notice_bytes + 1), None, keys) == "malformed"
    payload, headers = notice_message(notice(0), keys[0])
    assert read(payload, {**headers, "X-Padding": "x" * max_header_bytes}, keys) == "malformed"
    with pytest.raises(ValidationError):
        HopNotice.model_validate_json(notice(0).model_dump_json().replace(SESSION, "s" * 200))


def test_the_mac_header_is_bounded_to_its_exact_form():
    key = new_link_key()
    headers = with_mac(key, {"Hearth-Step": "1"}, b"payload")
    assert mac_is_valid(key, headers, b"payload")
    for claimed in ("a" * 1_000_000, "é" * 32, headers[HEADER_MAC].upper(), headers[HEADER_MAC][:-1]):
        assert not mac_is_valid(key, {**headers, HEADER_MAC: claimed}, b"payload")  # never raises
    padded = with_mac(key, {"Hearth-Step": "1", "X-Padding": "x" * max_header_bytes}, b"payload")
    assert not mac_is_valid(key, padded, b"payload")  # well MACed, but over the bound: not even hashed


def test_frame_and_ack_headers_over_the_bound_are_refused():
    frame = FrameHeader(pipeline_id=PIPELINE, hop=0, session=SESSION, step=1, kind=FrameKind.decode, pos=0,
                        chunk_index=0, chunk_count=1, dtype=WireDtype.float32, shape=(1, 1, 4), total_bytes=16)
    headers = frame.to_nats_headers()
    assert FrameHeader.from_nats_headers(headers) == frame.model_copy(update={"compute_dtype": WireDtype.float32})
    with pytest.raises(FrameError, match="headers"):
        FrameHeader.from_nats_headers({**headers, "X-Padding": "x" * max_header_bytes})
    ack = AckHeader.for_frame(frame).to_nats_headers()
    AckHeader.from_nats_headers(ack)
    with pytest.raises(FrameError, match="headers"):
        AckHeader.from_nats_headers({**ack, "X-Padding": "x" * max_header_bytes})


def test_an_int8_frame_declaring_a_huge_block_is_refused_and_restoring_needs_no_padding():
    shape = (1, 1, 4)
    header = dict(pipeline_id=PIPELINE, hop=0, session=SESSION, step=1, kind=FrameKind.decode, pos=0, chunk_index=0,
                  chunk_count=1, dtype=WireDtype.int8, compute_dtype=WireDtype.float32, shape=shape)
    frame = FrameHeader(**header, int8_block=64, total_bytes=wire_nbytes(WireDtype.int8, shape, 64))
    huge = 2**27  # before, restoring these 8 bytes of values took 3 s and 1 GiB
    with pytest.raises(FrameError):
        FrameHeader.from_nats_headers({**frame.to_nats_headers(), "Hearth-Int8-Block": str(huge)})
    with pytest.raises(ValidationError):
        FrameHeader(**header, int8_block=max_int8_block_elems + 1,
                    total_bytes=wire_nbytes(WireDtype.int8, shape, max_int8_block_elems + 1))
    values = torch.tensor([0.5, -1.0, 0.25, 2.0])
    for block in (1, 3, 4):
        restored = dequantize_int8_blockwise(quantize_int8_blockwise(values, block), shape, block, torch.float32)
        torch.testing.assert_close(restored.reshape(-1), values, rtol=0.01, atol=0.02)
    # One block holds the whole frame from 4 elements on: the same bytes restore the same values under any larger
    # block, without padding the values up to it.
    one_block = quantize_int8_blockwise(values, 4)
    assert torch.equal(dequantize_int8_blockwise(one_block, shape, huge, torch.float32),
                       dequantize_int8_blockwise(one_block, shape, 4, torch.float32))


def test_a_control_answer_that_is_no_reply_says_no():
    assert reply_says_ok(ControlReply(ok=True).model_dump_json().encode())
    assert not reply_says_ok(ControlReply(ok=False, code="unknown_pipeline").model_dump_json().encode())
    for garbage in (b"", b"not json", b'{"ok": "maybe"}', b"[" * 100_000):  # before: a ValidationError ended the call
        assert not reply_says_ok(garbage)


def test_shard_control_messages_are_bounded():
    fields = dict(pipeline_id=PIPELINE, session_id=SESSION, hop=0, hop_count=1, model_id="m", weights_sha256="w",
                  layer_lo=0, layer_hi=1)
    OpenHop(**fields, notice_key="A" * 43 + "=")
    for oversized in ({"model_id": "m" * 1_000_000}, {"weights_sha256": "w" * 1_000_000},
                      {"notice_key": "A" * 1000 + "="}):
        with pytest.raises(ValidationError):
            OpenHop(**{**fields, **oversized})
    with pytest.raises(ValidationError):
        ControlReply(ok=False, message="x" * 1_000_000)
    with pytest.raises(ValidationError):
        ShardStat(shard_id="s", active_streams=0, open_pipelines=["p"] * (max_open_pipelines + 1), cached_sessions=0,
                  cache_bytes=0)


def test_a_reported_failure_is_unverified_and_its_failover_blames_nobody(tmp_path):
    assert not StepFailure(UNVERIFIED_REPORT, "m:0-3@a", "hop 1 reported its input failed").verified
    assert StepFailure("corrupt", "m:4-7@b", "output failed the nan check", check="nan").verified
    engine = migrated_engine(tmp_path / "rm.sqlite")
    log = LogBuilder()
    a, b, c = "m:0-3@a", "m:4-7@b", "m:0-3@c"
    apply_all(engine, [log.stored(e) for e in [
        constructed("p1", [a, b], t=2),
        PipelineFailover(pipeline_id="p1", failed_shard_id=a, replacement_hops=[c, b], reason=UNVERIFIED_REPORT,
                         resumed_at_token=3, node_id="hub", occurred_at=at(3)),
    ]])
    with Session(engine) as session:
        assert session.get(ShardStats, a).failovers_caused == 0
    engine.dispose()


def test_a_refusal_for_a_pipeline_another_member_opened_first_or_of_an_open_not_verified_blames_nobody():
    assert not StepFailure("refused", "m:0-3@n", "taken", code="pipeline_taken").verified
    # The open's signature did not verify on the shard: this orchestrator's key or clock, not the shard, is at fault.
    assert not StepFailure("refused", "m:0-3@n", "stale", code="unauthorized").verified
    assert StepFailure("refused", "m:0-3@n", "full", code="at_capacity").verified
