"""Whether a shard takes one more hop: its streams, and each opener's share of them."""

from __future__ import annotations

from collections.abc import Collection

from hearth.protocol.control import ControlReply
from hearth.services.common.config import ShardSettings
from hearth.services.shard.hops import ServedHop


def admission_refusal(open_hops: Collection[ServedHop], opener: str | None,
                      settings: ShardSettings) -> ControlReply | None:
    """Why a new hop of `opener` (the member whose signature its open verified under; None on an open mesh) is not
    taken beside `open_hops`, or None. A re-open takes the place of the hop it replaces: not asked."""
    limit = settings.max_concurrent_streams
    if len(open_hops) >= limit:
        return ControlReply(ok=False, code="at_capacity", message=f"{len(open_hops)} of {limit} streams in use")
    held, share = sum(hop.opener == opener for hop in open_hops), settings.hops_per_opener
    if opener is not None and held >= share:  # see [shard] max_hops_per_opener
        return ControlReply(ok=False, code="at_capacity",
                            message=f"this orchestrator holds {held} of the {limit} streams here, its most")
    return None
