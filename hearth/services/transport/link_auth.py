"""LinkAuth: what one end of a keyed link does to its frames and acks, MAC-only or sealed, from the link key.

MAC-only, a frame carries ``Hearth-Mac`` over its headers and payload (hearth/services/transport/mac.py); sealed, its
payload is encrypted and, with its headers, authenticated instead (hearth/services/transport/seal.py). Acks carry no
activations: they are MACed either way.
"""

from __future__ import annotations

from collections.abc import Mapping

from hearth.services.transport.mac import (
    HEADER_ACK_WITNESS,
    HEADER_MAC,
    ack_witness,
    link_mac_key,
    mac_is_valid,
    message_mac,
    with_mac,
)
from hearth.services.transport.seal import LinkSeal, is_sealed


class LinkAuth:
    """The keys of one link as one end uses them: `sealed` is the link's mode, as `open` said."""

    def __init__(self, link_key: bytes, *, sealed: bool, ack_witness_key: bytes | None = None) -> None:
        self._mac_key = link_mac_key(link_key)
        self._seal = LinkSeal(link_key) if sealed else None
        # The receiving hop's own key for witnessing its acks (mac.py): the link's sender cannot make one.
        self._ack_witness_key = ack_witness_key

    @property
    def sealed(self) -> bool:
        return self._seal is not None

    def protect_frame(self, headers: dict[str, str], chunk: bytes | memoryview) -> bytes | memoryview:
        """The payload to publish with `headers` (completed with the MAC or the seal's nonce; they must be final)."""
        if self._seal is not None:
            return self._seal.seal(headers, chunk)
        headers[HEADER_MAC] = message_mac(self._mac_key, headers, chunk)
        return chunk

    def open_frame(self, headers: Mapping[str, str] | None, payload: bytes | memoryview) -> bytes | memoryview | None:
        """The frame's plaintext payload when it is authentic on this link, else None. On a sealed link a frame
        that is not sealed is refused, whatever it carries."""
        if self._seal is not None:
            return self._seal.open(headers, payload)
        return payload if mac_is_valid(self._mac_key, headers, payload) else None

    def frame_was_unsealed(self, headers: Mapping[str, str] | None) -> bool:
        """Whether a refused frame was refused on a sealed link for not being sealed at all."""
        return self._seal is not None and not is_sealed(headers)

    def sign_ack(self, headers: dict[str, str]) -> dict[str, str]:
        if self._ack_witness_key is not None:
            headers[HEADER_ACK_WITNESS] = ack_witness(self._ack_witness_key, headers)
        return with_mac(self._mac_key, headers, b"")

    def ack_is_valid(self, headers: Mapping[str, str] | None, payload: bytes) -> bool:
        return mac_is_valid(self._mac_key, headers, payload)
