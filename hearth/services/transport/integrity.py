"""Sanity checks on every received activation: NaN, Inf, and per-position L2 norms far outside past bounds."""

from __future__ import annotations

import heapq
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


def largest_norm(hidden: torch.Tensor) -> float | IntegrityCheck | None:
    """The largest per-position L2 norm of a frame, the check it fails when a position's is NaN or Inf, or None for
    an empty frame (nothing to check, nothing to learn from)."""
    # Three torch calls on the fast path: this runs on every hop of every token, with caches cold after the
    # layers, where each torch call is slow (BENCHMARKS.md, "`hearth bench`"). A NaN or an Inf anywhere
    # makes its position's norm NaN or Inf, and only then is it worth telling which. Half-precision inputs
    # are reduced in float32.
    if hidden.numel() == 0:
        return None
    norms = torch.linalg.vector_norm(hidden.detach(), dim=-1, dtype=torch.float32)
    largest = norms.max().item()
    if not math.isfinite(largest):
        return "nan" if bool(torch.isnan(hidden).any()) else "inf"
    return largest


class NormBounds:
    """Bounds on the per-position L2 norms at one point of the pipeline (a hop's input, the last hop's output), learnt
    from the frames that passed, per source (the shard a sink's frame comes from; a pipeline, or a member, at a shard's
    input: hearth/services/shard/input_checks.py).

    Until `min_sources` sources are known, a frame is checked against its own source's running maximum only (its
    first frame passes: nothing is known of it yet), so one source's frames never fail another's. From then on it is
    checked against the shared bound: the largest norm that at least two sources passed with (the second largest of
    their maxima, so no one source raises it alone, however large the frames it got through), capped at `factor`
    times the median of the sources' maxima (no two sources ratchet it up a little every step until corruption passes
    while the others are honest), and never lowered (a first frame of zeros, or many sources of near-zero frames,
    cannot make honest frames fail, and a first token's large norms stay covered however many later calls started
    from kept prefixes). Frames of zeros teach nothing. The most recent `max_sources` sources are remembered. What
    remains: once most known sources collude they set the median, and the first sources, if one party's, set the
    bound."""

    def __init__(self, factor: float = norm_bound_factor, *, min_sources: int = 3, max_sources: int = 64) -> None:
        self.factor = factor
        self.min_sources = min_sources
        self.max_sources = max_sources
        self._maxima: OrderedDict[Hashable, float] = OrderedDict()
        self._median: float | None = None  # of the maxima, recomputed when one changes
        self._bound: float | None = None

    @property
    def max_norm(self) -> float | None:
        """The largest norm a frame passed with (None before any)."""
        return max([*self._maxima.values(), *([] if self._bound is None else [self._bound])], default=None)

    @property
    def pooled(self) -> bool:
        """Whether frames are checked against the shared bound (enough sources known), not their own source's."""
        return len(self._maxima) >= self.min_sources and self._bound is not None

    def check(self, hidden: torch.Tensor, source: Hashable = None) -> IntegrityCheck | None:
        """The failed check's name, or None; learns `source`'s bound from a frame that passes."""
        largest = largest_norm(hidden)
        if largest is None or isinstance(largest, str):
            return largest
        if self.exceeds(largest, source):
            return "norm"
        self.learn(largest, source)
        return None

    def exceeds(self, largest: float, source: Hashable = None) -> bool:
        """Whether a frame whose largest norm is `largest` fails the norm check as `source`'s."""
        reference = self._bound if self.pooled else self._maxima.get(source)
        return reference is not None and largest > reference * self.factor

    def learn(self, largest: float, source: Hashable = None) -> None:
        """Learn from a frame of `source` that passed with `largest` as its largest norm."""
        if largest <= 0.0:
            return
        own = self._maxima.get(source)
        if own is None or largest > own:
            self._maxima[source] = largest
            if len(self._maxima) > self.max_sources:
                self._maxima.popitem(last=False)
            self._median = statistics.median(self._maxima.values())
            self._raise_bound()
        self._maxima.move_to_end(source)

    def _raise_bound(self) -> None:
        """Raise the shared bound to what a second source reached too, within `factor` of the median; never lower it."""
        if len(self._maxima) < 2:
            return
        second_largest = heapq.nlargest(2, self._maxima.values())[1]
        candidate = min(second_largest, self._median * self.factor)
        if self._bound is None or candidate > self._bound:
            self._bound = candidate
