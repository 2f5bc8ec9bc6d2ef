"""How far two computations of the same layers on the same input may differ and still count as the same answer:
the per-position relative error of one output against another, and the honest tolerance for each device, dtype
and weight scheme (BENCHMARKS.md, "Honest shards: tolerances")."""

from __future__ import annotations

import hashlib

import torch

# The largest relative error an event reports (a NaN or an overflow compares as infinitely wrong).
largest_reported_error = 1e30
# Norms below this are treated as this, so an all-zero reference position does not divide by zero.
smallest_reference_norm = 1e-6

# The largest per-position relative error an honest replica may show, by (device kind, activation dtype). Honest
# replicas differ only by summation order (a prefill against a decode step, another batch size, another
# kernel), so fp32 agrees to a few parts per million and half precision to a few parts per thousand after a
# whole layer range; a weight scheme rounds its weights the same way on every replica and adds nothing.
HONEST_TOLERANCE: dict[tuple[str, str], float] = {
    ("cpu", "float32"): 1e-3,
    ("cpu", "bfloat16"): 5e-2,
    ("cpu", "float16"): 5e-2,
    ("cuda", "float32"): 1e-2,
    ("cuda", "bfloat16"): 8e-2,
    ("cuda", "float16"): 8e-2,
}
# Used for a device or dtype the table does not name: the loosest honest bound above.
fallback_tolerance = max(HONEST_TOLERANCE.values())


def tolerance_for(device_kind: str | None, dtype: str) -> float:
    """The tolerance for comparing outputs computed on `device_kind` in `dtype` (the looser of the two ends')."""
    return HONEST_TOLERANCE.get((device_kind or "cpu", dtype), fallback_tolerance)


def position_errors(claimed: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per position (the second-last dimension), ||claimed - reference|| / ||reference||, in float32; both
    tensors have the same shape `[..., positions, hidden]`. NaN or Inf anywhere in `claimed` gives `inf` there."""
    if claimed.shape != reference.shape:
        raise ValueError(f"cannot compare outputs of shapes {tuple(claimed.shape)} and {tuple(reference.shape)}")
    claimed32, reference32 = claimed.detach().float(), reference.detach().float()
    difference = torch.linalg.vector_norm(claimed32 - reference32, dim=-1)
    scale = torch.linalg.vector_norm(reference32, dim=-1).clamp_min(smallest_reference_norm)
    errors = (difference / scale).reshape(-1)
    return torch.where(torch.isfinite(errors), errors, torch.full_like(errors, float("inf")))


def first_mismatch(errors: torch.Tensor, tolerance: float) -> int | None:
    """The index of the first position whose error exceeds `tolerance`, or None."""
    beyond = torch.nonzero(errors > tolerance)
    return int(beyond[0, 0]) if beyond.numel() else None


def reportable_error(error: float) -> float:
    """An error as an event can carry it (JSON has no infinity)."""
    return min(float(error), largest_reported_error)


def evidence_digest(*tensors: torch.Tensor) -> str:
    """sha256 over tensors as float32 bytes, in order: names compared activations without carrying them."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()
