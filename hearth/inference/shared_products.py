"""SharedRowProduct: one product for the quantized Linears of a module that read the same input (q, k and v; gate
and up), on a kernel that holds their weights side by side (int8 on fbgemm: hearth/inference/int8_kernels.py).

The first member called with an input computes every member's columns at once, the others take theirs while their
input holds the same values (compared after rounding to bfloat16, as the kernels take it, so an input changed in
place is computed again), and the product is let go once every member took its part. The kernel computes each
output column on its own (int8: exact int32 sums), so sharing changes no result; it saves each product's fixed cost
and the rounding of its input. torch's int4 CPU kernel gains nothing from it, so int4 keeps one product per Linear
(BENCHMARKS.md "Quantized shard kernels").
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


class SharedRowProduct:
    """``product`` maps rows rounded to bfloat16 to every member's columns side by side, ``widths`` wide each."""

    def __init__(self, product: Callable[[torch.Tensor], torch.Tensor], widths: Sequence[int]) -> None:
        self.product = product
        starts = [0, *itertools.accumulate(widths)]
        self.bounds = list(zip(starts[:-1], starts[1:], strict=True))
        self._kept = threading.local()

    def all_columns(self, rows: torch.Tensor) -> torch.Tensor:
        """Every member's product of ``rows`` side by side (``bounds`` says whose columns are where)."""
        return self.product(rows.to(torch.bfloat16, copy=True))

    def columns(self, member: int, rows: torch.Tensor) -> torch.Tensor:
        """Member ``member``'s product of ``rows`` (contiguous)."""
        rounded = rows.to(torch.bfloat16, copy=True)
        kept = getattr(self._kept, "entry", None)
        if kept is None or kept.rounded.shape != rounded.shape or not torch.equal(kept.rounded, rounded):
            kept = _KeptProduct(rounded, self.product(rounded))
            self._kept.entry = kept
        kept.taken.add(member)
        if len(kept.taken) == len(self.bounds):
            self._kept.entry = None
        first, last = self.bounds[member]
        part = kept.product[:, first:last]
        return part if part.is_contiguous() else part.contiguous()


@dataclass
class _KeptProduct:
    """A shared product's input (as rounded), its every column, and which members took theirs."""

    rounded: torch.Tensor
    product: torch.Tensor
    taken: set[int] = field(default_factory=set)
