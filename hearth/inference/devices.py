"""Choosing where and in what precision a process computes: `--device` and `--dtype` resolved against what torch
sees on this machine, and the memory figures a shard advertises for the device it computes on.

`auto` device: the first CUDA device when torch sees one, else the CPU. `auto` dtype: bf16 on a CUDA device that
supports it, fp16 on one that does not, fp32 on the CPU (bf16 and fp16 also run on the CPU when asked for).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

DEVICE_CHOICES = "auto|cpu|cuda|cuda:N"
DTYPE_CHOICES = ("auto", "fp32", "bf16", "fp16")
DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"
_device_re = re.compile(DEVICE_PATTERN)
_dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MiB = 1024 * 1024


class DeviceUnavailable(ValueError):
    """The asked device does not exist here (no CUDA, or no such CUDA index)."""


def resolve_device(spec: str | torch.device | None) -> torch.device:
    """The torch device for `auto|cpu|cuda|cuda:N` (None is `auto`); DeviceUnavailable when it is not here."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    text = (spec or "auto").strip().lower()
    if not _device_re.match(text):
        raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {spec!r}")
    if text == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceUnavailable(f"device {text!r} asked for, but torch sees no CUDA device here")
    index = int(text.partition(":")[2] or torch.cuda.current_device())
    if index >= torch.cuda.device_count():
        raise DeviceUnavailable(f"device {text!r} asked for, but torch sees {torch.cuda.device_count()} CUDA devices")
    return torch.device("cuda", index)


def resolve_compute_dtype(spec: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The compute dtype for `auto|fp32|bf16|fp16` (None is `auto`) on `device`."""
    if isinstance(spec, torch.dtype):
        return spec
    text = (spec or "auto").strip().lower()
    if text == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if text not in _dtypes:
        raise ValueError(f"dtype must be one of {'|'.join(DTYPE_CHOICES)}, got {spec!r}")
    return _dtypes[text]


def resolve_placement(device: str | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    """Device and compute dtype from their specs (None: auto); ValueError naming what is wrong."""
    compute_device = resolve_device(device)
    return compute_device, resolve_compute_dtype(dtype, compute_device)


@dataclass(frozen=True)
class DeviceDescription:
    """What a shard advertises about where it computes: `cpu` or `cuda`, and the device's name."""

    kind: str
    name: str


def describe_device(device: torch.device) -> DeviceDescription:
    if device.type == "cuda":
        return DeviceDescription("cuda", torch.cuda.get_device_name(device)[:64])
    import platform

    return DeviceDescription("cpu", (platform.processor() or platform.machine() or "cpu")[:64])


def device_memory_available_bytes(device: torch.device) -> int | None:
    """Bytes `device` has free for new allocations (blocking: call it off the event loop): the CUDA driver's free
    memory, or the kernel's MemAvailable for the CPU; None where neither can be read (not Linux)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # stated in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def device_memory_allocated_bytes(device: torch.device) -> int | None:
    """Bytes torch's allocator holds on a CUDA device right now; None on the CPU (no allocator to ask)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_allocated(device))


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
