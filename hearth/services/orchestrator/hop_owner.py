"""The owner key an orchestrator gives the hops it opens: a shard counts a later `close`, `keep` or re-open of a hop
only when it repeats that key (hearth/protocol/control.py, OpenHop.owner_key), so no other member can end, copy or take
over a call's hop by naming its pipeline and session ids, which travel in plain headers.

The key is derived from a secret of this process, the pipeline id and the shard: every chain of a pipeline (a
failover's re-open of a surviving hop too) presents the same key to a shard without carrying it around, no other
orchestrator can compute it, and no shard learns the key of another hop of the pipeline (which it could hand to an
orchestrator member to end or copy that hop).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from hearth.services.transport.mac import encode_link_key

_PROCESS_SECRET = secrets.token_bytes(32)


def owner_key(pipeline_id: str, shard_id: str) -> str:
    """This process's owner key for a pipeline's hop on a shard (the urlsafe base64 of 32 bytes, as a link key)."""
    # Pipeline ids are subject tokens and shard ids printable text: neither holds the NUL that separates them.
    message = f"{pipeline_id}\0{shard_id}".encode()
    return encode_link_key(hmac.new(_PROCESS_SECRET, message, hashlib.sha256).digest())
