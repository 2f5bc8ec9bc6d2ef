"""Sealed activations: a link's frames encrypted end to end with AES-256-GCM, so the broker's host sees only ciphertext.

The seal key of a link is derived from the link key that `open` hands to the link's two ends (HKDF under its own
label, hearth/services/transport/mac.py). Each frame's payload is sealed under a fresh random 96-bit nonce, sent as
``Hearth-Seal`` (24 lowercase hex digits); the associated data is every other header of the frame (``name:value\\n``
in name order, as for a MAC), so a frame opened with other headers (another pipeline, hop, session, step, chunk,
kind, position, dtype, shape or offset) fails, and a sealed frame needs no ``Hearth-Mac``. The payload is the
ciphertext followed by the 16-byte tag. Acks carry no activations: they keep their MAC.

Nonces are random rather than counted: a counter would have to survive a sender that is built again with the same
link key (a hop re-opened under the same keys), and a reused nonce breaks GCM, while a link seals far fewer than
2**32 frames, where random 96-bit nonces stay within GCM's collision bound. Why AES-256-GCM rather than
ChaCha20-Poly1305: BENCHMARKS.md, "Sealed activations".
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from hearth.services.transport.headers import oversized_headers
from hearth.services.transport.mac import SEAL_KEY_LABEL, derived_key

HEADER_SEAL = "Hearth-Seal"
seal_nonce_bytes = 12
seal_tag_bytes = 16
# Exactly what seal() writes: anything else is refused before any decryption is tried.
_NONCE_RE = re.compile(rf"[0-9a-f]{{{2 * seal_nonce_bytes}}}")


def associated_data(headers: Mapping[str, str]) -> bytes:
    """What a sealed frame's tag authenticates besides its payload: every header but the nonce, in name order."""
    return "".join(f"{name}:{headers[name]}\n" for name in sorted(headers) if name != HEADER_SEAL).encode()


def is_sealed(headers: Mapping[str, str] | None) -> bool:
    return bool(headers) and HEADER_SEAL in headers


class LinkSeal:
    """Seals and opens the frames of one link with the key derived from its link key."""

    def __init__(self, link_key: bytes) -> None:
        self._aead = AESGCM(derived_key(link_key, SEAL_KEY_LABEL))

    def seal(self, headers: dict[str, str], payload: bytes | memoryview) -> bytes:
        """The sealed payload; sets the nonce header in `headers`, which must be final (they are authenticated)."""
        nonce = os.urandom(seal_nonce_bytes)
        headers[HEADER_SEAL] = nonce.hex()
        return self._aead.encrypt(nonce, payload, associated_data(headers))

    def open(self, headers: Mapping[str, str] | None, payload: bytes | memoryview) -> bytes | None:
        """The frame's plaintext payload, or None when it is not sealed with this link's key for these headers
        (headers over max_header_bytes are refused unread)."""
        if not headers or oversized_headers(headers):
            return None
        nonce = headers.get(HEADER_SEAL)
        if nonce is None or not _NONCE_RE.fullmatch(nonce) or len(payload) < seal_tag_bytes:
            return None
        try:
            return self._aead.decrypt(bytes.fromhex(nonce), payload, associated_data(headers))
        except InvalidTag:
            return None
