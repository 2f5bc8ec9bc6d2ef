"""Getting a step's output off its GPU for the wire: one copy into pinned host memory and one synchronisation per
step, none per layer.

The layers of a step are queued on the device without waiting for any of them; the only wait is for the copy of
the step's output into a pinned host tensor, issued asynchronously right after the last layer. Pinned tensors come
from torch's caching host allocator, so after the first steps no page is pinned anew, and each output owns its
buffer (the transport may still be sending one step while the next is computed for another pipeline).
On the CPU the output is already where the wire wants it and passes through untouched.
"""

from __future__ import annotations

import torch


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the CPU: a pinned copy of a CUDA tensor (after one wait for its stream), else `tensor` itself."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    # The step's one synchronisation: its layers and this copy were queued on the current stream.
    torch.cuda.current_stream(tensor.device).synchronize()
    return host


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A received step's input on `device`, queued without waiting (the copy is ordered before the layers on the
    same stream)."""
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and not tensor.is_pinned():
        # From pageable memory a copy cannot be asynchronous; staging through pinned memory keeps the host free.
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
