"""The keys of an `open` sealed to its shard host's member key, and the owner proofs of `close` and `keep`: on a
community mesh no key a hop is opened with travels in clear past the broker (docs/protocol.md, Sealed hop keys).

An open's link, notice and owner keys go in a libsodium sealed box to the host member's key (hearth/trust/keys.py),
bound to the member that signs the open and to the pipeline, session and hop it opens: the box says nothing of who
sealed it, so the host counts it only in an open signed by the member it names (another member copying it into an
open of its own gets a refusal, not the victim's hop). A `close` or `keep` proves it comes from the hop's orchestrator
with an HMAC under the owner key over the whole request: the key itself never travels again. The MAC covers the
session id, and every chain draws a fresh one, so a captured close replayed later closes nothing (that session is
gone) and a captured keep only repeats itself while its session lives; no clock or nonce cache is needed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hearth.protocol.bounds import SUBJECT_TOKEN_PATTERN, max_pipeline_hops
from hearth.protocol.control import LINK_KEY_PATTERN, CloseHop, KeepHop, OpenHop
from hearth.services.transport.mac import decode_link_key, derived_key
from hearth.trust.keys import PUBLIC_KEY_PATTERN, MemberKey, sealed_to

OWNER_PROOF_KEY_LABEL = b"hearth hop owner proof v1"
_KEY_FIELDS = ("inbound_link_key", "outbound_link_key", "notice_key", "owner_key")


class HopKeys(BaseModel):
    """What OpenHop.sealed_keys holds once opened: the open's keys, and what they count for."""

    model_config = ConfigDict(extra="forbid")

    opener: str = Field(pattern=PUBLIC_KEY_PATTERN)  # the member key that signs the open
    pipeline_id: str = Field(pattern=SUBJECT_TOKEN_PATTERN)
    session_id: str = Field(pattern=SUBJECT_TOKEN_PATTERN)
    hop: int = Field(ge=0, lt=max_pipeline_hops)
    inbound_link_key: str | None = Field(default=None, pattern=LINK_KEY_PATTERN)
    outbound_link_key: str | None = Field(default=None, pattern=LINK_KEY_PATTERN)
    notice_key: str | None = Field(default=None, pattern=LINK_KEY_PATTERN)
    owner_key: str | None = Field(default=None, pattern=LINK_KEY_PATTERN)


def seal_hop_keys(request: OpenHop, host_public_key: str, opener_public_key: str) -> OpenHop:
    """`request` with its keys sealed to the host member's key, for an open `opener_public_key` signs; ValueError for
    a malformed host key."""
    keys = HopKeys(opener=opener_public_key, pipeline_id=request.pipeline_id, session_id=request.session_id,
                   hop=request.hop, **{name: getattr(request, name) for name in _KEY_FIELDS})
    sealed = sealed_to(host_public_key, keys.model_dump_json().encode())
    return request.model_copy(update={"sealed_keys": base64.urlsafe_b64encode(sealed).decode(),
                                      **dict.fromkeys(_KEY_FIELDS)})


def unsealed_hop_keys(request: OpenHop, host_key: MemberKey, signer_public_key: str | None) -> OpenHop | str:
    """`request` with the keys of its `sealed_keys` in their fields (as an open mesh's open carries them), or why they
    do not count here: not sealed to this host's key, altered, or bound to another signer, pipeline, session or hop."""
    if request.sealed_keys is None:
        return "its keys are not sealed to this host's member key"
    try:
        plaintext = host_key.unseal(base64.urlsafe_b64decode(request.sealed_keys.encode()))
        keys = None if plaintext is None else HopKeys.model_validate_json(plaintext)
    except (binascii.Error, ValueError, ValidationError):
        keys = None
    if keys is None:
        return "its sealed keys do not open with this host's member key"
    if (keys.opener, keys.pipeline_id, keys.session_id, keys.hop) != (
            signer_public_key, request.pipeline_id, request.session_id, request.hop):
        return "its sealed keys were sealed for another open (signer, pipeline, session or hop)"
    opened = {**request.model_dump(exclude={"sealed_keys"}), **keys.model_dump(include=set(_KEY_FIELDS))}
    try:
        return OpenHop.model_validate(opened)  # its checks again, now that the keys are in
    except ValidationError:
        return "its sealed keys do not fit the open"


def _owner_mac(owner_key: str, request: CloseHop | KeepHop) -> str:
    signed = request.model_dump_json(exclude={"owner_key", "owner_proof"}).encode()
    return hmac.new(derived_key(decode_link_key(owner_key), OWNER_PROOF_KEY_LABEL), signed, hashlib.sha256).hexdigest()


def with_owner_proof(request: CloseHop | KeepHop, owner_key: str) -> CloseHop | KeepHop:
    """`request` proving it comes from whoever holds the hop's owner key, without carrying the key."""
    return request.model_copy(update={"owner_key": None, "owner_proof": _owner_mac(owner_key, request)})


def proves_owner(request: CloseHop | KeepHop, owner_key: str) -> bool:
    """Whether `request` repeats `owner_key` (an orchestrator from before owner proofs) or proves it holds it. A proof
    counts only for a request naming its session: one without could be replayed against the pipeline's later ones."""
    if request.owner_key is not None:
        return hmac.compare_digest(request.owner_key, owner_key)
    return (request.owner_proof is not None and request.session_id is not None
            and hmac.compare_digest(request.owner_proof, _owner_mac(owner_key, request)))


def keys_for_host(request: OpenHop, host_key: MemberKey | None, signer_public_key: str | None) -> OpenHop | str:
    """The open as a host holding `host_key` (its member key; None on an open mesh) serves it, keys in their fields, or
    why it refuses it: on a community mesh keys count only sealed to that key (in clear, the broker has read them)."""
    if host_key is None:
        return request if request.sealed_keys is None else "this host has no member key to open sealed keys with"
    if any(request.plain_keys()):
        return "on a community mesh an open's keys travel sealed to its host's member key (sealed_keys), never in clear"
    return request if request.sealed_keys is None else unsealed_hop_keys(request, host_key, signer_public_key)
