"""Statistical guards on what each layer range outputs, learned only from outputs a check confirmed, so that a
lying host cannot widen them by lying a little more each time (the running maximum of
hearth/services/transport/integrity.py learns from whatever passed)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# (model id, first layer, last layer, quantization): the outputs of one layer range, whoever computes them.
RangeKey = tuple[str, int, int, str]


@dataclass
class NormRange:
    """The smallest and largest per-position L2 norm of confirmed outputs, and how many positions taught them."""

    low: float = math.inf
    high: float = 0.0
    positions: int = 0


class RangeGuards:
    """Per layer range: the per-position norm range of confirmed outputs; an output beyond it, by more than
    `margin` either way, is suspect (checked at once), never refused on that alone."""

    def __init__(self, margin: float, min_positions: int) -> None:
        if margin <= 1:
            raise ValueError(f"a guard's margin must be above 1, got {margin}")
        self.margin = margin
        self.min_positions = min_positions
        self._ranges: dict[RangeKey, NormRange] = {}

    def learned(self, key: RangeKey) -> bool:
        """Whether enough confirmed positions taught the range its bounds."""
        known = self._ranges.get(key)
        return known is not None and known.positions >= self.min_positions

    def learn(self, key: RangeKey, confirmed: torch.Tensor) -> None:
        """Widen the range to cover `confirmed` outputs ([..., positions, hidden]), which a check confirmed."""
        norms = _norms(confirmed)
        if norms.numel() == 0:
            return
        known = self._ranges.setdefault(key, NormRange())
        known.low = min(known.low, float(norms.min()))
        known.high = max(known.high, float(norms.max()))
        known.positions += int(norms.numel())

    def suspect(self, key: RangeKey, output: torch.Tensor) -> bool:
        """Whether `output` lies beyond the learned range (False while the range is not learned yet)."""
        if not self.learned(key):
            return False
        norms = _norms(output)
        if norms.numel() == 0:
            return False
        known = self._ranges[key]
        lowest, highest = float(norms.min()), float(norms.max())
        if not (math.isfinite(lowest) and math.isfinite(highest)):
            return True
        return highest > known.high * self.margin or lowest < known.low / self.margin


def _norms(hidden: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(hidden.detach(), dim=-1, dtype=torch.float32).reshape(-1)
