"""Which kernel a CPU layer range's linear projections run on: torch's nn.Linear as transformers builds it, or
oneDNN's linear operator on the same weights, for batched decode steps only (the default) or for every step.

Why oneDNN: on the AMD EPYC CPUs measured, torch's nn.Linear goes to MKL, whose products of a few rows cost about
what as many one-row products do, so a batched decode step gained less than it could; oneDNN's linear operator on the
same dense weights (no copy, no extra memory) is faster at every number of rows, most for a few (BENCHMARKS.md,
"oneDNN for batched steps, torch for one session's"). Its products round differently from MKL's, so:
- "onednn-batched" (the default) runs a step of one session (``[1, T, hidden]``: solo decode, every prefill) on
  nn.Linear, bitwise equal to transformers' generate() as the design's parity rule asks, and a batched decode step
  (``[B > 1, 1, hidden]``, already not bitwise equal to the rows' solo steps: its GEMM rounds per batch) on oneDNN;
- "onednn" runs every step on oneDNN (fastest alone too; not bitwise equal to generate(), greedy tokens matched in
  every run measured);
- "torch" leaves transformers' modules alone.

The operator is torch's ``mkldnn._linear_pointwise``, the one torch.compile's CPU backend emits for a linear layer.
torch has no public function that runs oneDNN's linear on dense float32 weights (torch.utils.mkldnn's module first
copies them into oneDNN's layout and is TorchScript, deprecated), so where this torch lacks the operator the layers
keep nn.Linear and the log says so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

CPU_LINEAR_KERNELS: tuple[str, ...] = ("torch", "onednn-batched", "onednn")
DEFAULT_CPU_LINEAR_KERNEL = "onednn-batched"


def onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(inputs, weight, bias)`` computed by oneDNN (float32 CPU tensors; rounds differently from MKL)."""
    return torch.ops.mkldnn._linear_pointwise(inputs, weight, bias, "none", [], "")


class OneDnnLinear(nn.Linear):
    """An nn.Linear holding the very parameters of the one it replaces, whose product runs on oneDNN for batched
    inputs (leading dimension above one) or, with ``batched_only`` False, for every input."""

    def __init__(self, dense: nn.Linear, *, batched_only: bool) -> None:
        nn.Module.__init__(self)  # nn.Linear's own __init__ would allocate fresh weights
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.weight, self.bias = dense.weight, dense.bias
        self.batched_only = batched_only

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.batched_only and (inputs.dim() < 3 or inputs.shape[0] == 1):
            return F.linear(inputs, self.weight, self.bias)
        return onednn_linear(inputs, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, batched_only={self.batched_only}"


def use_cpu_linear_kernel(layers: Iterable[nn.Module], kernel: str, device: torch.device,
                          dtype: torch.dtype) -> bool:
    """Swap the layers' nn.Linear modules for OneDnnLinear when `kernel` asks for oneDNN and the layers hold float32
    weights on the CPU (elsewhere torch's stay); True when swapped. The layers' own code is unchanged: it calls its
    submodules as before."""
    if kernel not in CPU_LINEAR_KERNELS:
        raise ValueError(f"cpu_linear_kernel must be one of {', '.join(CPU_LINEAR_KERNELS)}, not {kernel!r}")
    if kernel == "torch" or device.type != "cpu" or dtype != torch.float32:
        return False
    if not onednn_linear_available():
        log.info("cpu_linear_kernel %s: this torch has no oneDNN linear operator; torch's kernels stay", kernel)
        return False
    for layer in layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, OneDnnLinear(child, batched_only=kernel == "onednn-batched"))
    return True
