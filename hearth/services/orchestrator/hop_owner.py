"""The owner key an orchestrator gives the hops it opens: a shard counts a later `close`, `keep` or re-open of a hop
only when it repeats that key (hearth/protocol/control.py, OpenHop.owner_key), so no other member can end, copy or take
over a call's hop by naming its pipeline and session ids, which travel in plain headers. On a community mesh that key
never travels in clear: an `open` carries it sealed to the host, a `close` or `keep` a proof it holds it (key_seal.py).

An orchestrator on a community mesh also signs each `open` with its member key (`open_signer`), as a client signs a
call: a shard tells by the signer whose hops it holds, and lets no one orchestrator hold more than its share of them
(`[shard] max_hops_per_opener`), so no member can fill a shard with hops it keeps alive.

The key is derived from a secret of this process, the pipeline id and the shard: every chain of a pipeline (a
failover's re-open of a surviving hop too) presents the same key to a shard without carrying it around, no other
orchestrator can compute it, and no shard learns the key of another hop of the pipeline (which it could hand to an
orchestrator member to end or copy that hop).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable

from hearth.protocol.control import CloseHop, ControlReply, KeepHop, OpenHop
from hearth.services.common.call_signing import signed_call_headers
from hearth.services.common.config import HearthSettings
from hearth.services.common.event_trust import member_public_keys
from hearth.services.common.logged_steward_keys import StewardKeysFromTheLog
from hearth.services.transport.key_seal import seal_hop_keys, with_owner_proof
from hearth.services.transport.mac import encode_link_key
from hearth.trust.keys import MemberKey

_PROCESS_SECRET = secrets.token_bytes(32)


def owner_key(pipeline_id: str, shard_id: str) -> str:
    """This process's owner key for a pipeline's hop on a shard (the urlsafe base64 of 32 bytes, as a link key)."""
    # Pipeline ids are subject tokens and shard ids printable text: neither holds the NUL that separates them.
    message = f"{pipeline_id}\0{shard_id}".encode()
    return encode_link_key(hmac.new(_PROCESS_SECRET, message, hashlib.sha256).digest())


class OpenSigner:
    """Signs an `open` (its control subject, its body) with this orchestrator's member key, signed as a call is with no
    reply subject (of the members only the shard listens on its control subject), and seals the open's keys to its
    host's member key first (hearth/services/transport/key_seal.py): the broker and the steward's `system` role read
    the open too."""

    def __init__(self, key: MemberKey, member_keys: Callable[[str], str | None] | None) -> None:
        self.key, self._member_keys = key, member_keys  # a member's public key by its name (= its node id)

    def __call__(self, control_subject: str, body: bytes) -> dict[str, str]:
        return signed_call_headers(self.key, control_subject, "", body)

    def sealed(self, request: OpenHop, host_node: str) -> OpenHop | None:
        """`request` with its keys sealed to the member of `host_node`; None when the roster has no such member."""
        host_key = self._member_keys(host_node) if self._member_keys is not None else None
        return None if host_key is None else seal_hop_keys(request, host_key, self.key.public_key)


def open_signer(key: MemberKey | None, member_keys: Callable[[str], str | None] | None = None) -> OpenSigner | None:
    """What signs (and seals the keys of) this orchestrator's `open`s; None on an open mesh, where opens go unsigned
    with their keys in clear. `member_keys`: a roster member's public key by name (event_trust.member_public_keys)."""
    return None if key is None else OpenSigner(key, member_keys)


def community_open_signer(key: MemberKey | None, settings: HearthSettings,
                          steward_keys: StewardKeysFromTheLog | None = None) -> OpenSigner | None:
    """This orchestrator's open signer, sealing to the members of its community's roster, each under the key the logs
    `steward_keys` follows rotated it to; None on an open mesh."""
    return open_signer(key, member_public_keys(settings, steward_keys))


def open_message(request: OpenHop, host_node: str, control_subject: str,
                 signer: OpenSigner | None) -> tuple[bytes, dict[str, str] | None] | ControlReply:
    """The body and headers of an `open` to a shard on `host_node`: on a community mesh its keys sealed and it signed;
    a refusal (never sent) when the host's member key is not known to seal them to."""
    if signer is None:
        return request.model_dump_json().encode(), None
    sealed = signer.sealed(request, host_node)
    if sealed is None:
        return ControlReply(ok=False, code="unauthorized",
                            message=f"node {host_node} is not in the roster: no member key to seal the hop's keys to")
    body = sealed.model_dump_json().encode()
    return body, signer(control_subject, body)


def proven(request: CloseHop | KeepHop, shard_id: str) -> CloseHop | KeepHop:
    """A `close` or `keep` of our hop on `shard_id` proving it is ours without revealing the owner key."""
    return with_owner_proof(request, owner_key(request.pipeline_id, shard_id))
