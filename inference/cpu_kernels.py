"""Which kernel a CPU layer range's linear projections run on: torch's nn.Linear as transformers builds it, or
oneDNN through torch's public module swap (torch.utils.mkldnn), which batched decode steps gain from.

Why oneDNN: on the project's 2-core VM (AMD EPYC, AVX-512), a 6-layer step of llama-250m with MKL's nn.Linear costs
as much for 2 rows as for 2 single rows, while oneDNN's gain from batching starts at 2 rows (runner level, one thread:
2 rows 1.45 x one by one instead of 1.02 x, 4 rows 2.61 x instead of 2.21 x; BENCHMARKS.md). The price: its products
round differently from nn.Linear's, so hidden states are no longer bitwise equal to transformers' generate(); greedy
tokens matched in every run measured. Hence opt-in ([research.distributed_inference.host] cpu_linear_kernel).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

log = logging.getLogger(__name__)

CPU_LINEAR_KERNELS: tuple[str, ...] = ("torch", "onednn")


def use_cpu_linear_kernel(layers: Iterable[nn.Module], kernel: str, device: torch.device,
                          dtype: torch.dtype) -> bool:
    """Swap the layers' nn.Linear modules for oneDNN's when `kernel` is "onednn" and the layers hold float32
    weights on the CPU (oneDNN's linear module keeps fp32 weights; elsewhere the setting does not apply and torch's
    stay); True when swapped. The layers' own code is unchanged: it calls its submodules as before."""
    if kernel not in CPU_LINEAR_KERNELS:
        raise ValueError(f"cpu_linear_kernel must be one of {', '.join(CPU_LINEAR_KERNELS)}, not {kernel!r}")
    if kernel == "torch":
        return False
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        log.info("cpu_linear_kernel %s applies to float32 layers on a CPU with oneDNN; these are %s on %s: "
                 "torch's kernels stay", kernel, dtype, device)
        return False
    from torch.utils import mkldnn  # here, not at the top: importing it warns that TorchScript is deprecated

    for layer in layers:
        mkldnn.to_mkldnn(layer)
    return True
