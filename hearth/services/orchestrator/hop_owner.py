"""The owner key an orchestrator gives the hops it opens: a shard counts a later `close`, `keep` or re-open of a hop
only when it repeats that key (hearth/protocol/control.py, OpenHop.owner_key), so no other member can end, copy or take
over a call's hop by naming its pipeline and session ids, which travel in plain headers.

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

from hearth.services.common.call_signing import signed_call_headers
from hearth.services.transport.mac import encode_link_key
from hearth.trust.keys import MemberKey

_PROCESS_SECRET = secrets.token_bytes(32)


def owner_key(pipeline_id: str, shard_id: str) -> str:
    """This process's owner key for a pipeline's hop on a shard (the urlsafe base64 of 32 bytes, as a link key)."""
    # Pipeline ids are subject tokens and shard ids printable text: neither holds the NUL that separates them.
    message = f"{pipeline_id}\0{shard_id}".encode()
    return encode_link_key(hmac.new(_PROCESS_SECRET, message, hashlib.sha256).digest())


def open_signer(key: MemberKey | None) -> Callable[[str, bytes], dict[str, str]] | None:
    """What signs an `open` (its control subject, its body) with this orchestrator's member key: signed as a call is,
    with no reply subject (only the shard reads its control subject); None on an open mesh, where opens go unsigned."""
    if key is None:
        return None
    return lambda control_subject, body: signed_call_headers(key, control_subject, "", body)
