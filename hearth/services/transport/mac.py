"""Keyed BLAKE2b MACs for the activation transport: each link (sender -> hop) gets a fresh key when its pipeline
is opened, every frame and ack on that link carries a MAC over its headers and payload, and a receiver drops
whatever fails it, so a member that may publish on activation subjects still cannot inject or alter a step.
The MAC key of a link is derived from the link key with HKDF under its own label (the seal key of sealed links,
hearth/services/transport/seal.py, under another), so the two never share key material.
Hop notices carry one too, keyed with a key only that hop and its orchestrator hold, and so do acks besides their
link's MAC (``Hearth-Ack-Witness``, with a key derived from the notice key): the hop before a hop holds their link's
key, and must not be able to ack in that hop's name (the orchestrator's stall watch blames by acks)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets
from collections.abc import Mapping

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from hearth.services.transport.headers import oversized_headers

HEADER_MAC = "Hearth-Mac"
HEADER_ACK_WITNESS = "Hearth-Ack-Witness"
link_key_bytes = 32
mac_digest_bytes = 16
# Exactly what message_mac writes: anything else (too long, not ASCII) is refused before it is compared.
_MAC_RE = re.compile(rf"[0-9a-f]{{{2 * mac_digest_bytes}}}")


# HKDF labels (`info`) of the keys derived from one link key: one per use, never shared.
MAC_KEY_LABEL = b"hearth link mac v1"
SEAL_KEY_LABEL = b"hearth link seal v1"
ACK_WITNESS_KEY_LABEL = b"hearth ack witness v1"  # derived from a hop's notice key, not from a link key


class LinkKeyError(ValueError):
    """A link key on the wire is not base64 of the right length."""


def new_link_key() -> bytes:
    return secrets.token_bytes(link_key_bytes)


def derived_key(link_key: bytes, label: bytes) -> bytes:
    """The key for one use (`label`) of a link key: HKDF-SHA256, no salt (the link key is already uniformly random)."""
    return HKDF(algorithm=hashes.SHA256(), length=link_key_bytes, salt=None, info=label).derive(link_key)


def link_mac_key(link_key: bytes) -> bytes:
    """The key the MACs of a link's frames and acks are made with."""
    return derived_key(link_key, MAC_KEY_LABEL)


def encode_link_key(key: bytes) -> str:
    return base64.urlsafe_b64encode(key).decode()


def decode_link_key(text: str) -> bytes:
    try:
        key = base64.urlsafe_b64decode(text.encode())
    except (binascii.Error, ValueError):
        raise LinkKeyError("a link key is not base64") from None
    if len(key) != link_key_bytes:
        raise LinkKeyError(f"a link key has {len(key)} bytes, not {link_key_bytes}")
    return key


def message_mac(key: bytes, headers: Mapping[str, str], payload: bytes | memoryview) -> str:
    """The MAC of one message: every header but the MAC itself, in name order (so transport reordering of
    headers does not matter), then the payload."""
    digest = hashlib.blake2b(key=key, digest_size=mac_digest_bytes)
    for name in sorted(headers):
        if name != HEADER_MAC:
            digest.update(f"{name}:{headers[name]}\n".encode())
    digest.update(b"\n")
    digest.update(payload)
    return digest.hexdigest()


def with_mac(key: bytes, headers: dict[str, str], payload: bytes | memoryview) -> dict[str, str]:
    headers[HEADER_MAC] = message_mac(key, headers, payload)
    return headers


def _claimed_mac(headers: Mapping[str, str] | None, name: str) -> str | None:
    """Header `name` when it holds exactly what message_mac writes; None for one absent or of another form, and for
    headers over max_header_bytes (refused unread)."""
    if not headers or oversized_headers(headers):
        return None
    claimed = headers.get(name)
    return claimed if claimed is not None and _MAC_RE.fullmatch(claimed) else None


def mac_is_valid(key: bytes, headers: Mapping[str, str] | None, payload: bytes | memoryview) -> bool:
    """Whether the message carries a MAC of this key; headers over max_header_bytes are refused unread."""
    claimed = _claimed_mac(headers, HEADER_MAC)
    return claimed is not None and hmac.compare_digest(claimed, message_mac(key, headers, payload))


def ack_witness_key(notice_key: bytes) -> bytes:
    """The key a hop's acks are witnessed with: known to that hop and its orchestrator only."""
    return derived_key(notice_key, ACK_WITNESS_KEY_LABEL)


def ack_witness(key: bytes, headers: Mapping[str, str]) -> str:
    """The witness of an ack: a MAC over its headers but the MACs."""
    return message_mac(key, {name: value for name, value in headers.items()
                             if name not in (HEADER_MAC, HEADER_ACK_WITNESS)}, b"")


def ack_witness_is_valid(key: bytes, headers: Mapping[str, str] | None) -> bool:
    """Whether the ack carries the witness of this key (checked as `mac_is_valid` checks a MAC)."""
    claimed = _claimed_mac(headers, HEADER_ACK_WITNESS)
    return claimed is not None and hmac.compare_digest(claimed, ack_witness(key, headers))
