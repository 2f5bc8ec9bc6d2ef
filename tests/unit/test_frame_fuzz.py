"""Activation frames, acks, notices and keepalives as a hostile member sends them (hypothesis), the one that holds a
link's key (the hop before) among them: headers missing, wrongly typed, at extremes, declaring huge or impossible
tensors, payloads cut or overlong. A header is parsed or refused with a FrameError naming it; a receiver takes a step
or drops the frame without raising and without allocating past its pipeline's bounds (a frame declaring 2**40
elements is refused before anything is allocated); an ack, a notice or a keepalive is read or ignored."""

from __future__ import annotations

import asyncio
import tracemalloc
from types import SimpleNamespace

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hearth.protocol.control import HopNotice
from hearth.services.transport import ActivationReceiver, FrameKind, StepInfo, StepLimits, encode_step
from hearth.services.transport.acks import AckObserver
from hearth.services.transport.errors import FrameError
from hearth.services.transport.frames import decode_frames
from hearth.services.transport.headers import AckHeader, FrameHeader
from hearth.services.transport.keepalives import keepalive_message, keepalive_number
from hearth.services.transport.link_auth import LinkAuth
from hearth.services.transport.mac import ack_witness_key
from hearth.services.transport.notices import notice_message, read_notice
from hearth.services.transport.sender import AckWindowSender
from hearth.services.transport.wire import WireDtype, wire_nbytes

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PIPELINE = "pipe-fuzz"
HIDDEN = 16
MAX_TOKENS = 64
LIMITS = StepLimits.for_pipeline(hidden_size=HIDDEN, max_tokens=MAX_TOKENS)
# A receiver without its pipeline's limits (an orchestrator's before it knows the model) still has the host's.
HOST_MAX_STEP_BYTES = 2**20
LINK_KEY = b"k" * 32
NAMES = ("Hearth-Pipeline", "Hearth-Hop", "Hearth-Session", "Hearth-Step", "Hearth-Chunk", "Hearth-Kind", "Hearth-Pos",
         "Hearth-Prompt-Tokens", "Hearth-Dtype", "Hearth-Compute-Dtype", "Hearth-Shape", "Hearth-Offset",
         "Hearth-Bytes", "Hearth-Int8-Block", "Hearth-Sent-Ns", "Hearth-Acked-Ns", "Hearth-Mac", "Other")
# What NATS delivers as a header value: any text but a line break (nats-py decodes bytes as UTF-8, replacing).
header_text = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\r\n"), max_size=30)
header_value = st.one_of(
    header_text, st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(["0", "18446744073709551616", "9" * 20, "9" * 21, " 1", "+1", "0x10", "\uff11", "\u0663", "1.5",
                     "nan", "1,68719476736,16", "0,999999999999,999999999999", "1,1,16,", "1" * 5000, "0/1", "1/0",
                     "0/999999999", "999999999/999999999", "int8", "float32", "reset", "decode", "replay"]))
dims = st.lists(st.one_of(st.sampled_from([0, 1, HIDDEN, 2**31, 2**36, 10**12 - 1]), st.integers(0, 4096)),
                min_size=1, max_size=8)


@st.composite
def declared_tensor(draw) -> dict[str, str]:
    """Headers declaring a tensor consistently (its bytes match its dtype and shape), of any size."""
    shape, dtype = tuple(draw(dims)), draw(st.sampled_from(list(WireDtype)))
    block = draw(st.sampled_from([1, 7, 2**16])) if dtype is WireDtype.int8 else None
    total = wire_nbytes(dtype, shape, block)
    headers = {"Hearth-Shape": ",".join(map(str, shape)), "Hearth-Dtype": dtype.value, "Hearth-Bytes": str(total),
               "Hearth-Chunk": draw(st.sampled_from(["0/1", "0/2", "1/2", "0/999999999"])),
               "Hearth-Offset": draw(st.sampled_from(["0", "1024", str(total)]))}
    if block is not None:
        headers.update({"Hearth-Int8-Block": str(block), "Hearth-Compute-Dtype": "float32"})
    return headers


changes = st.one_of(st.dictionaries(st.sampled_from(NAMES), st.one_of(st.none(), header_value), max_size=3),
                    declared_tensor())


def _frames(kind: FrameKind, wire: WireDtype | None, tokens: int) -> list[tuple[dict[str, str], bytes]]:
    tensor = None if kind is FrameKind.reset else torch.randn(1, tokens, HIDDEN)
    encoded = encode_step(StepInfo(session="s", step=1, kind=kind, pos=0), tensor, wire_dtype=wire, chunk_bytes=1024,
                          int8_block=7)
    return [(encoded.header(PIPELINE, 1, index, sent_ns=5).to_nats_headers(), bytes(chunk))
            for index, chunk in enumerate(encoded.chunks)]


def _changed(headers: dict[str, str], change: dict[str, str | None]) -> dict[str, str]:
    changed = {**headers, **{name: value for name, value in change.items() if value is not None}}
    return {name: value for name, value in changed.items() if change.get(name, "") is not None}


@FUZZ
@given(kind=st.sampled_from(list(FrameKind)), wire=st.sampled_from([None, WireDtype.int8, WireDtype.float16]),
       tokens=st.integers(1, 40), change=changes, payload=st.one_of(st.none(), st.binary(max_size=3000)))
@example(kind=FrameKind.prefill, wire=None, tokens=1, payload=b"",
         change={"Hearth-Shape": "0,999999999999,999999999999", "Hearth-Bytes": "0", "Hearth-Offset": "0"})
def test_any_frame_headers_are_parsed_or_refused_naming_one_and_a_parsed_frame_decodes_or_is_refused(
        kind, wire, tokens, change, payload):
    headers, chunk = _frames(kind, wire, 1 if kind is FrameKind.decode else tokens)[0]
    headers = _changed(headers, change)
    try:
        header = FrameHeader.from_nats_headers(headers)
    except FrameError as refused:
        assert "\n" not in str(refused)
        return
    if header.chunk_count == 1 and header.total_bytes <= 4096:  # a whole step in one frame: restored or refused
        try:
            decode_frames([(header, chunk if payload is None else payload)])
        except FrameError:
            pass


class _Connection:
    """What a receiver or sender asks of its NATS connection, without a broker."""

    max_payload = 2**20
    stats = {"reconnects": 0}

    async def publish(self, subject: str, payload: bytes, headers=None) -> None:
        pass


@FUZZ
@given(kind=st.sampled_from(list(FrameKind)), wire=st.sampled_from([None, WireDtype.int8]),
       tokens=st.integers(1, 40), damage=st.lists(changes, min_size=1, max_size=3),
       payload=st.one_of(st.none(), st.binary(max_size=3000)), limits=st.booleans(),
       link=st.sampled_from([None, "mac", "seal"]))
def test_a_receiver_takes_or_drops_any_frames_within_its_bounds_even_from_the_holder_of_the_link_key(
        kind, wire, tokens, damage, payload, limits, link):
    pipeline_limits = StepLimits.for_pipeline(hidden_size=HIDDEN, max_tokens=MAX_TOKENS,
                                              activation_dtype="int8" if wire is WireDtype.int8 else "auto")
    receiver = ActivationReceiver(_Connection(), PIPELINE, 1, step_limits=pipeline_limits if limits else None,
                                  max_step_bytes=HOST_MAX_STEP_BYTES, ready_wait_timeout_s=0.0,
                                  link_key=LINK_KEY if link else None, seal=link == "seal")
    sender = LinkAuth(LINK_KEY, sealed=link == "seal") if link else None  # the hop before: it holds the key

    async def send_all() -> None:
        for index, (headers, chunk) in enumerate(_frames(kind, wire, 1 if kind is FrameKind.decode else tokens)):
            headers = _changed(headers, damage[index] if index < len(damage) else {})
            data = payload if payload is not None and index == 0 else chunk
            if sender is not None:
                data = sender.protect_frame(headers, data)
            await receiver._on_frame(SimpleNamespace(headers=headers, data=data, subject=receiver.subject))

    tracemalloc.start()
    try:
        asyncio.run(send_all())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Unfinished steps hold two of the largest at most, complete ones two more (transport/ready.py); the rest is slack.
    assert peak < 4 * receiver.max_step_bytes + 2**20
    frames = len(_frames(kind, wire, 1 if kind is FrameKind.decode else tokens))
    if payload is None and not any(damage[:frames]):  # nothing changed: the step comes through
        assert receiver.stats.steps_received == 1


def test_a_frame_declaring_2_to_the_40_elements_is_refused_before_anything_is_allocated():
    headers = {"Hearth-Pipeline": PIPELINE, "Hearth-Hop": "1", "Hearth-Session": "s", "Hearth-Step": "1",
               "Hearth-Chunk": "0/2", "Hearth-Kind": "prefill", "Hearth-Pos": "0", "Hearth-Dtype": "float32",
               "Hearth-Shape": f"1,{2**36},16", "Hearth-Offset": "0", "Hearth-Bytes": str(4 * 2**40)}
    for limits, reason in ((LIMITS, "positions"), (None, "size")):
        refused = []

        async def on_refused(header, refusal, refused=refused):
            refused.append(refusal.reason)

        receiver = ActivationReceiver(_Connection(), PIPELINE, 1, step_limits=limits, on_refused=on_refused)
        tracemalloc.start()
        try:
            asyncio.run(receiver._on_frame(SimpleNamespace(headers=headers, data=b"\0" * 1024, subject="s")))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert refused == [reason] and receiver.stats.refused_frames == 1 and not receiver._partial
        assert peak < 2**20


ACK = AckHeader(pipeline_id=PIPELINE, hop=1, session="s", step=1, chunk_index=0, chunk_count=2)
WITNESS_KEY = ack_witness_key(b"w" * 32)


@FUZZ
@given(change=st.dictionaries(st.sampled_from(NAMES), st.one_of(st.none(), header_value), max_size=3),
       witnessed=st.booleans(), payload=st.sampled_from([b"", b"x", b"\0" * 5000]))
def test_an_observer_and_a_sender_read_or_ignore_any_ack_even_one_with_the_link_key(change, witnessed, payload):
    headers = _changed(ACK.to_nats_headers(), change)
    LinkAuth(LINK_KEY, sealed=False, ack_witness_key=WITNESS_KEY if witnessed else None).sign_ack(headers)
    observer = AckObserver(None, PIPELINE, sink_hop=2, link_keys={1: LINK_KEY}, ack_witness_keys={1: WITNESS_KEY},
                           max_chunks_per_step=4)  # type: ignore[arg-type]
    sender = AckWindowSender(_Connection(), PIPELINE, 1, link_key=LINK_KEY)  # type: ignore[arg-type]
    sender._in_flight[("s", 1, 0)] = 0.0
    message = SimpleNamespace(headers=headers, data=payload, subject="hearth.ack.x")
    asyncio.run(observer._on_ack(message))
    asyncio.run(sender._on_ack(message))


NOTICE = HopNotice(pipeline_id=PIPELINE, session_id="s", hop=0, step=1, problem="input_failed_check", check="nan")
NOTICE_KEY = b"n" * 32


@FUZZ
@given(change=st.dictionaries(st.sampled_from(["Hearth-Mac", "Other"]), st.one_of(st.none(), header_value),
                              max_size=2),
       body=st.one_of(st.binary(max_size=3000), st.just(notice_message(NOTICE, NOTICE_KEY)[0])),
       number=st.one_of(st.binary(max_size=30), st.integers(-(2**70), 2**70).map(lambda n: str(n).encode())))
def test_a_notice_and_a_keepalive_are_read_or_refused_whatever_they_carry(change, body, number):
    _, mac = notice_message(NOTICE, NOTICE_KEY)
    read = read_notice(body, _changed(mac or {}, change), pipeline_id=PIPELINE, session_id="s",
                       notice_keys=[NOTICE_KEY])
    assert read is None or read in ("malformed", "mac") or isinstance(read, HopNotice)
    _, alive = keepalive_message(7, {0: NOTICE_KEY})
    told = keepalive_number(number, _changed(alive, {"Hearth-Alive-0": change.get("Hearth-Mac")}), 0, NOTICE_KEY)
    assert told is None or (told >= 0 and number == str(told).encode())
