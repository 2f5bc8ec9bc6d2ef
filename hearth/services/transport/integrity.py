"""Sanity checks on every received activation: NaN, Inf, and per-position L2 norms far outside past bounds."""

from __future__ import annotations

import math
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
    """Running max of per-position L2 norms at one point of the pipeline (one hop's output)."""

    def __init__(self, factor: float = norm_bound_factor) -> None:
        self.factor = factor
        self.max_norm: float | None = None

    def check(self, hidden: torch.Tensor) -> IntegrityCheck | None:
        """The failed check's name, or None; learns the bounds from frames that pass."""
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
        if self.max_norm is not None and largest > self.max_norm * self.factor:
            return "norm"
        self.max_norm = largest if self.max_norm is None else max(self.max_norm, largest)
        return None
