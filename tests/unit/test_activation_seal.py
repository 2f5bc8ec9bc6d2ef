"""Sealed activation frames: a frame sealed with a link's key opens to its exact bytes on that link only; tampered
ciphertext, another key, the frame's headers moved to another step, chunk or link, and a frame that is not sealed
at all (MACed only, or in clear) are all refused; the seal and MAC keys of a link are distinct; `open` carries the
mode and refuses a sealed hop without its link keys."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from hearth.protocol.control import OpenHop
from hearth.services.transport import FrameError, FrameKind, StepInfo, decode_frames, encode_step
from hearth.services.transport.headers import HEADER_CHUNK, HEADER_HOP, HEADER_PIPELINE, HEADER_STEP, FrameHeader
from hearth.services.transport.link_auth import LinkAuth
from hearth.services.transport.mac import (
    HEADER_MAC,
    MAC_KEY_LABEL,
    SEAL_KEY_LABEL,
    derived_key,
    encode_link_key,
    link_mac_key,
    new_link_key,
)
from hearth.services.transport.seal import HEADER_SEAL, LinkSeal, seal_tag_bytes

PIPELINE = "p-seal"


def sealed_frames(auth: LinkAuth, tensor: torch.Tensor, *, step: int = 1, hop: int = 0, chunk_bytes: int = 1 << 20):
    """(headers, payload) of every chunk of one step, as the sender publishes them."""
    kind = FrameKind.decode if tensor.shape[-2] == 1 else FrameKind.prefill
    encoded = encode_step(StepInfo(session="s1", step=step, kind=kind, pos=0), tensor, chunk_bytes=chunk_bytes)
    frames = []
    for index, chunk in enumerate(encoded.chunks):
        headers = encoded.header(PIPELINE, hop, index).to_nats_headers()
        payload = auth.protect_frame(headers, chunk)
        frames.append((headers, bytes(payload)))
    return frames


def opened(auth: LinkAuth, frames) -> torch.Tensor | None:
    plain = []
    for headers, payload in frames:
        opened_payload = auth.open_frame(headers, payload)
        if opened_payload is None:
            return None
        plain.append((FrameHeader.from_nats_headers(headers), opened_payload))
    return decode_frames(plain)[1]


@pytest.mark.parametrize("shape, dtype", [((1, 1, 2048), torch.float32), ((1, 64, 2048), torch.bfloat16)])
def test_a_sealed_step_opens_bitwise_on_its_link_and_carries_no_plaintext(shape, dtype):
    key = new_link_key()
    tensor = torch.randn(shape).to(dtype)
    frames = sealed_frames(LinkAuth(key, sealed=True), tensor, chunk_bytes=64 * 1024)
    restored = opened(LinkAuth(key, sealed=True), frames)
    assert restored is not None and torch.equal(restored.view(torch.uint8), tensor.view(torch.uint8))
    raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    for headers, payload in frames:
        assert HEADER_SEAL in headers and HEADER_MAC not in headers
        assert raw[:64] not in payload and raw[-64:] not in payload
        assert len(payload) == min(64 * 1024, len(raw) - int(headers["Hearth-Offset"])) + seal_tag_bytes


def test_tampered_ciphertext_another_key_and_moved_headers_are_refused():
    key = new_link_key()
    auth = LinkAuth(key, sealed=True)
    [(headers, payload)] = sealed_frames(auth, torch.randn(1, 1, 256))
    assert auth.open_frame(headers, payload) is not None
    flipped = bytearray(payload)
    flipped[5] ^= 1
    assert auth.open_frame(headers, bytes(flipped)) is None
    assert auth.open_frame(headers, payload[:-1]) is None
    assert LinkAuth(new_link_key(), sealed=True).open_frame(headers, payload) is None
    # The same bytes replayed as another step, chunk, hop or pipeline: the headers are the associated data.
    for name, value in ((HEADER_STEP, "2"), (HEADER_CHUNK, "0/2"), (HEADER_HOP, "1"), (HEADER_PIPELINE, "p-other")):
        assert auth.open_frame({**headers, name: value}, payload) is None, name
    # A nonce that is not the one sealed with, or not a nonce at all.
    for nonce in ("0" * 24, headers[HEADER_SEAL].upper(), headers[HEADER_SEAL][:-2], ""):
        assert auth.open_frame({**headers, HEADER_SEAL: nonce}, payload) is None


def test_a_step_replayed_into_another_link_or_step_does_not_open():
    link0, link1 = new_link_key(), new_link_key()
    tensor = torch.randn(1, 1, 128)
    frames = sealed_frames(LinkAuth(link0, sealed=True), tensor, step=7, hop=0)
    assert opened(LinkAuth(link1, sealed=True), frames) is None  # hop 1's receiver holds another link's key
    moved = [({**headers, HEADER_STEP: "8"}, payload) for headers, payload in frames]
    assert opened(LinkAuth(link0, sealed=True), moved) is None
    assert opened(LinkAuth(link0, sealed=True), frames) is not None


def test_a_frame_that_is_not_sealed_is_refused_on_a_sealed_link():
    key = new_link_key()
    tensor = torch.randn(1, 1, 128)
    sealed = LinkAuth(key, sealed=True)
    for sender in (LinkAuth(key, sealed=False), None):  # MACed with the link's own MAC key, or in clear
        encoded = encode_step(StepInfo(session="s1", step=1, kind=FrameKind.decode), tensor)
        headers = encoded.header(PIPELINE, 0, 0).to_nats_headers()
        payload = sender.protect_frame(headers, encoded.chunks[0]) if sender else encoded.chunks[0]
        assert sealed.open_frame(headers, payload) is None
        assert sealed.frame_was_unsealed(headers)
    # And the other way round: a sealed frame is not a MAC-only link's frame either.
    [(headers, payload)] = sealed_frames(sealed, tensor)
    assert LinkAuth(key, sealed=False).open_frame(headers, payload) is None
    assert not sealed.frame_was_unsealed(headers)


def test_every_frame_gets_a_fresh_nonce():
    seal = LinkSeal(new_link_key())
    nonces = set()
    for _ in range(64):
        headers = {HEADER_STEP: "1"}
        seal.seal(headers, b"same payload")
        nonces.add(headers[HEADER_SEAL])
    assert len(nonces) == 64


def test_the_seal_and_mac_keys_of_a_link_are_distinct_and_acks_stay_maced():
    key = new_link_key()
    mac_key, seal_key = derived_key(key, MAC_KEY_LABEL), derived_key(key, SEAL_KEY_LABEL)
    assert len({key, mac_key, seal_key}) == 3 and link_mac_key(key) == mac_key
    auth = LinkAuth(key, sealed=True)
    ack = auth.sign_ack({HEADER_STEP: "1", HEADER_CHUNK: "0/1"})
    assert HEADER_MAC in ack and auth.ack_is_valid(ack, b"")
    assert not LinkAuth(new_link_key(), sealed=True).ack_is_valid(ack, b"")


def test_a_sealed_frame_does_not_decode_as_the_step_it_carries():
    key = new_link_key()
    tensor = torch.randn(1, 1, 256)
    [(headers, payload)] = sealed_frames(LinkAuth(key, sealed=True), tensor)
    header = FrameHeader.from_nats_headers(headers)
    with pytest.raises(FrameError):  # the tag makes it longer than the step it declares
        decode_frames([(header, payload)])
    _, garbage = decode_frames([(header, payload[:-seal_tag_bytes])])
    assert not torch.equal(garbage, tensor)


def test_open_carries_the_mode_and_a_sealed_hop_needs_its_link_keys():
    keys = dict(inbound_link_key=encode_link_key(new_link_key()), outbound_link_key=encode_link_key(new_link_key()))
    common = dict(pipeline_id=PIPELINE, session_id="s1", hop=0, hop_count=1, model_id="m", weights_sha256="w",
                  layer_lo=0, layer_hi=1)
    assert OpenHop(**common, **keys, seal_activations=True).seal_activations
    assert not OpenHop(**common, **keys).seal_activations  # absent: an orchestrator of before sealing, MAC-only
    with pytest.raises(ValidationError, match="seal_activations needs"):
        OpenHop(**common, seal_activations=True)
    with pytest.raises(ValidationError):
        OpenHop(**common, **keys, seal_activations="maybe")
