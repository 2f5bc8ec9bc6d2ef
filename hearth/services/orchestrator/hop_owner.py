"""The owner key an orchestrator gives the hops it opens: a shard counts a later `close`, `keep` or re-open of a hop
only when it repeats that key (hearth/protocol/control.py, OpenHop.owner_key), so no other member can end, copy or take
over a call's hop by naming its pipeline and session ids, which travel in plain headers.

The key is derived from a secret of this process and the pipeline id: every chain of a pipeline (a failover's re-open
of a surviving hop too) presents the same key without carrying it around, and no other orchestrator can compute it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from hearth.services.transport.mac import encode_link_key

_PROCESS_SECRET = secrets.token_bytes(32)


def owner_key(pipeline_id: str) -> str:
    """This process's owner key for a pipeline's hops (the urlsafe base64 of 32 bytes, as a link key)."""
    return encode_link_key(hmac.new(_PROCESS_SECRET, pipeline_id.encode(), hashlib.sha256).digest())
