"""How far two computations of the same layers on the same input may differ and still count as the same answer:
the per-position relative error of one output against another, and the honest tolerance for each device, dtype
and weight scheme (BENCHMARKS.md, "Honest shards: tolerances")."""

from __future__ import annotations

import hashlib

import torch

# The largest relative error an event reports (a NaN or an overflow compares as infinitely wrong): within what an
# event's numbers may be (hearth/events/models.py max_event_number, 2^40), or the event would not validate.
largest_reported_error = 1e12
# Norms below this are treated as this, so an all-zero reference position does not divide by zero.
smallest_reference_norm = 1e-6

# The largest per-position relative error an honest replica may show, by (device kind, compute dtype, whether the
# weights are quantized): about ten times (float32 with full weights: twenty-five times) the largest error honest
# computations showed (BENCHMARKS.md, "Honest shards: tolerances"). Honest replicas differ by summation order only (one
# prefill against chunks and decode steps, a batch's rows, another kernel), but a step's output rounds to its dtype,
# and a quantized scheme's kernels round every product's inputs to bfloat16 even in a float32 layer, so only float32
# with full weights is tight enough to catch a lie of about 1 % per position; elsewhere such a lie is within honest
# rounding.
HONEST_TOLERANCE: dict[tuple[str, str, bool], float] = {
    ("cpu", "float32", False): 1e-4,
    ("cpu", "float32", True): 6e-2,
    ("cpu", "bfloat16", False): 1.5e-1,
    ("cpu", "bfloat16", True): 1.5e-1,
    # Not measured: float16 keeps three more mantissa bits than bfloat16, whose bound covers it.
    ("cpu", "float16", False): 1.5e-1,
    ("cpu", "float16", True): 1.5e-1,
}
# What rounding activations to the wire dtype (`activation_dtype`) adds; `auto` sends the compute dtype as it is.
WIRE_TOLERANCE: dict[str, float] = {"auto": 0.0, "fp32": 0.0, "fp16": 3e-3, "bf16": 2.5e-2, "int8": 7e-2}
# Used for a device, dtype or wire the tables do not name (a GPU: not measured yet): the loosest bounds above.
fallback_tolerance = max(HONEST_TOLERANCE.values())
fallback_wire_tolerance = max(WIRE_TOLERANCE.values())


def tolerance_for(device_kind: str | None, dtype: str, quantization: str = "none",
                  wire_dtype: str | None = None) -> float:
    """The tolerance for comparing outputs of layers computed on `device_kind` in `dtype` with weights in
    `quantization`, sent in the wire dtype setting `wire_dtype` (None: the compute dtype, unchanged)."""
    compute = HONEST_TOLERANCE.get((device_kind or "cpu", dtype, quantization != "none"), fallback_tolerance)
    return compute + WIRE_TOLERANCE.get(wire_dtype or "auto", fallback_wire_tolerance)


def looser_dtype(first: str | None, second: str) -> str:
    """Of two computations' dtypes, the one with the looser honest tolerance: what comparing them is judged by."""
    return second if first is None else max((first, second), key=lambda dtype: tolerance_for(None, dtype))


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
    """An error as an event can carry it (JSON has no infinity or NaN)."""
    error = float(error)
    return error if error <= largest_reported_error else largest_reported_error  # NaN compares false too


def evidence_digest(*tensors: torch.Tensor) -> str:
    """sha256 over tensors as float32 bytes, in order: names compared activations without carrying them."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()
