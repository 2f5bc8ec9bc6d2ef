"""How far a quantized model's next-token predictions lie from its full-precision reference's: KL divergence, top-1
agreement and each one's negative log-likelihood of the text, as sums that windows add up."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QualityTotals:
    """Sums over scored positions; ``+`` joins two windows' totals."""

    positions: int = 0
    kl_sum_nats: float = 0.0
    max_kl_nats: float = 0.0
    agreements: int = 0
    reference_nll_sum_nats: float = 0.0
    quantized_nll_sum_nats: float = 0.0

    def __add__(self, other: QualityTotals) -> QualityTotals:
        return QualityTotals(
            positions=self.positions + other.positions,
            kl_sum_nats=self.kl_sum_nats + other.kl_sum_nats,
            max_kl_nats=max(self.max_kl_nats, other.max_kl_nats),
            agreements=self.agreements + other.agreements,
            reference_nll_sum_nats=self.reference_nll_sum_nats + other.reference_nll_sum_nats,
            quantized_nll_sum_nats=self.quantized_nll_sum_nats + other.quantized_nll_sum_nats,
        )

    @property
    def mean_kl_nats(self) -> float:
        """Mean over positions of KL(reference || quantized) of the next-token distributions."""
        return self.kl_sum_nats / self.positions if self.positions else math.nan

    @property
    def top1_agreement(self) -> float:
        """Fraction of positions where both models' most likely next token is the same."""
        return self.agreements / self.positions if self.positions else math.nan

    @property
    def reference_perplexity(self) -> float:
        return _perplexity(self.reference_nll_sum_nats, self.positions)

    @property
    def quantized_perplexity(self) -> float:
        return _perplexity(self.quantized_nll_sum_nats, self.positions)


def _perplexity(nll_sum_nats: float, positions: int) -> float:
    return math.exp(nll_sum_nats / positions) if positions else math.nan


def compare_logits(reference_logits: torch.Tensor, quantized_logits: torch.Tensor,
                   targets: torch.Tensor) -> QualityTotals:
    """The totals of ``[T, vocab]`` next-token logits of both models at T positions, whose true next tokens are the
    ``[T]`` ``targets``. Computed in float64, so a KL of well under float32's resolution is not lost to rounding."""
    if reference_logits.dim() != 2 or reference_logits.shape != quantized_logits.shape:
        raise ValueError(f"logits must both be [T, vocab], got {list(reference_logits.shape)} and "
                         f"{list(quantized_logits.shape)}")
    if targets.shape != reference_logits.shape[:1]:
        raise ValueError(f"targets must be [{reference_logits.shape[0]}], got {list(targets.shape)}")
    reference = torch.log_softmax(reference_logits.double(), dim=-1)
    quantized = torch.log_softmax(quantized_logits.double(), dim=-1)
    # Exact zeros for equal inputs; tiny negative rounding of a near-zero KL is clamped, as KL >= 0.
    kl = (reference.exp() * (reference - quantized)).sum(dim=-1).clamp(min=0.0)
    targets = targets.long().unsqueeze(-1)
    return QualityTotals(
        positions=int(targets.shape[0]),
        kl_sum_nats=float(kl.sum()),
        max_kl_nats=float(kl.max()) if kl.numel() else 0.0,
        agreements=int((reference.argmax(dim=-1) == quantized.argmax(dim=-1)).sum()),
        reference_nll_sum_nats=-float(reference.gather(-1, targets).sum()),
        quantized_nll_sum_nats=-float(quantized.gather(-1, targets).sum()),
    )
