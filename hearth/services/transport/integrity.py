"""Sanity checks on every received activation: NaN, Inf, and per-position L2 norms far outside past bounds."""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict
from collections.abc import Hashable
from typing import Literal, get_args

import torch

from hearth.services.common.metrics import counter

IntegrityCheck = Literal["nan", "inf", "norm"]

# An honest hop's per-position norms stay within a small factor of what it produced before; a corrupted
# one (activations multiplied by 1e4, garbage bytes) lands orders of magnitude away.
norm_bound_factor = 50.0

integrity_failures_total = counter(
    "hearth_integrity_failures_total",
    "Received activation frames that failed a sanity check, by check and where they were checked "
    "(`sink`: the orchestrator, after the last hop; `hop_input`: a shard, before running its layers).",
    ["check", "checked_at"],
)
for _check in get_args(IntegrityCheck):  # read 0, not nothing, before any failure
    for _checked_at in ("sink", "hop_input"):
        integrity_failures_total.labels(check=_check, checked_at=_checked_at)


def count_integrity_failure(check: IntegrityCheck, checked_at: str) -> None:
    integrity_failures_total.labels(check=check, checked_at=checked_at).inc()


class NormBounds:
    """Bounds on the per-position L2 norms at one point of the pipeline (a hop's input, the last hop's output), learnt
    from the frames that passed, per source: the pipeline or the shard a frame comes from.

    Once `min_sources` sources are known, a frame is checked against the median of their running maxima, which no
    one source moves: not down with a first frame of zeros (after which every honest frame failed), nor up by raising
    its frames a little every step until a corrupted one passed. Before, it is checked against its own source's running
    maximum only, so one source's frames never fail another's (its first frame passes: nothing is known of it yet).
    Frames of zeros teach nothing, and once the median stands a new source far below it is not learnt. The most recent
    `max_sources` sources are remembered. What remains: a majority of sources that are one member's (the first few
    pipelines on a fresh shard, say) can still set the median."""

    def __init__(self, factor: float = norm_bound_factor, *, min_sources: int = 3, max_sources: int = 64) -> None:
        self.factor = factor
        self.min_sources = min_sources
        self.max_sources = max_sources
        self._maxima: OrderedDict[Hashable, float] = OrderedDict()
        self._median: float | None = None  # of the maxima, recomputed when one changes

    @property
    def max_norm(self) -> float | None:
        """The largest norm any remembered source's frames passed with (None before any)."""
        return max(self._maxima.values(), default=None)

    def check(self, hidden: torch.Tensor, source: Hashable = None) -> IntegrityCheck | None:
        """The failed check's name, or None; learns `source`'s bound from a frame that passes."""
        # Three torch calls on the fast path: this runs on every hop of every token, with caches cold after the
        # layers, where each torch call is slow (BENCHMARKS.md, "`hearth bench`"). A NaN or an Inf anywhere
        # makes its position's norm NaN or Inf, and only then is it worth telling which. Half-precision inputs
        # are reduced in float32.
        if hidden.numel() == 0:
            return None  # nothing to check, nothing to learn from
        norms = torch.linalg.vector_norm(hidden.detach(), dim=-1, dtype=torch.float32)
        largest = norms.max().item()
        if not math.isfinite(largest):
            return "nan" if bool(torch.isnan(hidden).any()) else "inf"
        own = self._maxima.get(source)
        pooled = len(self._maxima) >= self.min_sources
        reference = self._median if pooled else own
        if reference is not None and largest > reference * self.factor:
            return "norm"
        # A source is learnt from frames with something in them and, once the median stands, none far below it:
        # many sources of near-zero frames (pipelines are cheap to open) would otherwise drag the median down.
        if largest <= 0.0 or (own is None and pooled and largest * self.factor < self._median):
            return None
        if own is None or largest > own:
            self._maxima[source] = largest
            if len(self._maxima) > self.max_sources:
                self._maxima.popitem(last=False)
            self._median = statistics.median(self._maxima.values())
        self._maxima.move_to_end(source)
        return None
