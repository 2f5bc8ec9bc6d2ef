"""Nearest-rank percentiles: the one definition of every p50 / p95 a hearth process reports of its own samples."""

from __future__ import annotations

import math
from collections.abc import Sequence


def nearest_rank(ordered: Sequence[float], fraction: float) -> float | None:
    """The smallest of the sorted values with at least `fraction` of them at or below it; None without values."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]
