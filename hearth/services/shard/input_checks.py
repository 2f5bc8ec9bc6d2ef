"""HopInputChecks: the sanity check a shard runs on every step's input before its layers (NaN, Inf, and per-position
L2 norms far above what this shard has received before), with the norm bounds it learns from what passed.

The norm bounds are kept per shard, across pipelines, keyed by the first layer the hop runs (the input of layer L has
the same scale whoever sends it, and a shard used from different first layers sees different inputs): a per-pipeline
bound would learn nothing before a pipeline's first frame, so a shard corrupting from its first step on would pass.
The source a frame counts for (transport.integrity.NormBounds) is the member that opened its hop (its orchestrator,
which chose the hops before it): a member may open as many pipelines as it likes, so a source per pipeline let one
member set the median of the sources and raise the bound until another member's corrupted input passed. One member is
one source: it cannot lower the bound the others are checked against, nor raise it alone. On an open mesh, where opens
are not told apart, each pipeline is still a source of its own.
"""

from __future__ import annotations

import threading

from hearth.protocol.control import OpenHop
from hearth.services.transport import ReceivedStep
from hearth.services.transport.integrity import NormBounds


class HopInputChecks:
    """The shard's running input norm bounds, one per first layer run; safe to use from several threads."""

    def __init__(self) -> None:
        self._bounds: dict[int, NormBounds] = {}
        # The prefill thread checks inputs beside the compute thread; a bound must not lose what either learnt.
        self._lock = threading.Lock()

    def check(self, request: OpenHop, received: ReceivedStep, opener: str | None) -> str | None:
        """The check the step's input failed, or None (then its bound has learnt from it). `opener`: the member whose
        signature the hop's open verified under (None on an open mesh)."""
        source = ("member", opener) if opener is not None else ("pipeline", request.pipeline_id)
        with self._lock:
            bounds = self._bounds.setdefault(request.layer_lo, NormBounds())
            return bounds.check(received.tensor, source)
