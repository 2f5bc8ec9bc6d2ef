"""HopInputChecks: the sanity check a shard runs on every step's input before its layers (NaN, Inf, and per-position
L2 norms far above what this shard has received before), with the norm bounds it learns from what passed.

The norm bounds are kept per shard, across pipelines, keyed by the first layer the hop runs (the input of layer L has
the same scale whoever sends it, and a shard used from different first layers sees different inputs): a per-pipeline
bound would learn nothing before a pipeline's first frame, so a shard corrupting from its first step on would pass.

Whose frames teach which bound (transport.integrity.NormBounds, whose shared bound no one source raises alone): a
member may open as many pipelines as it likes, so pipelines alone as sources let one member set the median and the
bound, and another member's corrupted input then passed. So the bounds are learnt on two levels. Each member that opens
hops here (its orchestrator chose the hops before them) has bounds of its own over its pipelines, as sources: a host
before one of its pipelines ratchets none of them up alone, and no other member's frames move them. Across members,
each member is one source: once three members are known, every frame is checked against the bound they share, which
no one member raises alone nor, being never lowered, drags down. Before that, a frame is checked against its own
member's bounds. On an open mesh, where opens are not told apart, all pipelines are one member's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from hearth.protocol.control import OpenHop
from hearth.services.transport import ReceivedStep
from hearth.services.transport.integrity import IntegrityCheck, NormBounds, largest_norm

# Members whose own bounds a shard keeps per first layer (the least recently heard forgotten first); a roster's
# orchestrators are far fewer.
max_members_remembered = 64


class MemberNormBounds:
    """One point's bounds: shared across members, and each member's own over its pipelines."""

    def __init__(self) -> None:
        self.across_members = NormBounds(max_sources=max_members_remembered)
        self._members: OrderedDict[str | None, NormBounds] = OrderedDict()

    def check(self, received: ReceivedStep, pipeline_id: str, member: str | None) -> IntegrityCheck | None:
        largest = largest_norm(received.tensor)
        if largest is None or isinstance(largest, str):
            return largest
        own = self._members.get(member)
        if own is None:
            own = self._members[member] = NormBounds()
            if len(self._members) > max_members_remembered:
                self._members.popitem(last=False)
        self._members.move_to_end(member)
        if self.across_members.pooled and member is not None:
            failed = self.across_members.exceeds(largest, member)
        else:
            failed = own.exceeds(largest, pipeline_id)
        if failed:
            return "norm"
        own.learn(largest, pipeline_id)
        if member is not None:
            self.across_members.learn(largest, member)
        return None


class HopInputChecks:
    """The shard's running input norm bounds, one per first layer run; safe to use from several threads."""

    def __init__(self) -> None:
        self._bounds: dict[int, MemberNormBounds] = {}
        # The prefill thread checks inputs beside the compute thread; a bound must not lose what either learnt.
        self._lock = threading.Lock()

    def check(self, request: OpenHop, received: ReceivedStep, opener: str | None) -> str | None:
        """The check the step's input failed, or None (then its bounds have learnt from it). `opener`: the member whose
        signature the hop's open verified under (None on an open mesh)."""
        with self._lock:
            bounds = self._bounds.setdefault(request.layer_lo, MemberNormBounds())
            return bounds.check(received, request.pipeline_id, opener)
