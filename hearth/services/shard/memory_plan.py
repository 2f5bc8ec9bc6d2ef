"""What a shard's layer range needs on its device (weights plus its KV reserve), before loading (from the checkpoint's
headers) and after (measured), and the refusal when that is more than `[shard] max_memory_mb` allows.

The KV reserve is the shard's KV budget: `kv_cache_budget_mb` where set, else no more than its streams' sessions at
the model's whole context need in its layers (ShardSettings.shard_kv_budget_bytes). The runner keeps every session's
cache within it (hearth/services/shard/hops.py turns an eviction into a typed answer), so weights plus reserve bound
what the shard holds on its device.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hearth.inference import LayerRangeRunner
from hearth.inference.devices import MiB, device_memory_allocated_bytes
from hearth.inference.gguf_checkpoint import default_read_device
from hearth.inference.memory import full_context_session_kv_bytes, layer_weight_bytes, megabytes, range_weight_bytes
from hearth.inference.quantization import QuantizationScheme
from hearth.services.common.config_processes import ShardSettings


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes of a range's weights and of its KV reserve on one device."""

    weight_bytes: int
    kv_reserve_bytes: int

    @property
    def required_mb(self) -> float:
        return megabytes(self.weight_bytes + self.kv_reserve_bytes)


def kv_reserve_bytes(shard: ShardSettings) -> int:
    """The most KV reserve any range takes here (`hearth host` plans its range within its budget less this: the
    reserve of a range is known once it is chosen, and is no more)."""
    return shard.kv_cache_budget_bytes


def estimated_need(model_path: Path, lo: int, hi: int, dtype: torch.dtype, shard: ShardSettings,
                   quantization: QuantizationScheme | str = "none",
                   device: torch.device | str = default_read_device) -> MemoryNeed:
    """What layers lo..hi will need once loaded in `dtype`, quantized and held on `device`, from the checkpoint's
    headers and config alone; its KV reserve is the budget the range's runner is to be given."""
    per_layer = layer_weight_bytes(model_path, dtype, quantization=quantization, device=device)
    session_bytes = full_context_session_kv_bytes(model_path, lo, hi, dtype)
    return MemoryNeed(range_weight_bytes(per_layer, lo, hi), shard.shard_kv_budget_bytes(session_bytes))


def measured_need(runner: LayerRangeRunner, allocated_before: int | None) -> MemoryNeed:
    """What the loaded range holds on its device: torch's allocator's growth on a GPU (so padding and buffers
    count too), the bytes of its tensors on the CPU; plus the KV reserve (the runner's budget)."""
    allocated_after = device_memory_allocated_bytes(runner.device)
    if allocated_before is not None and allocated_after is not None:
        weights = max(allocated_after - allocated_before, runner.weight_bytes)
    else:
        weights = runner.weight_bytes
    return MemoryNeed(weights, runner.cache_budget_bytes)


def refusal(lo: int, hi: int, need: MemoryNeed, shard: ShardSettings, *, measured: bool) -> str | None:
    """Why the range may not be served here (both numbers named), or None when it fits."""
    # In bytes, as `hearth host` plans: the need rounded to a thousandth of a MB could pass the budget it fits.
    if need.weight_bytes + need.kv_reserve_bytes <= int(shard.max_memory_mb * MiB):
        return None
    how = "need" if measured else "would need"
    return (f"layers {lo}-{hi} {how} {need.required_mb:.1f} MB ({megabytes(need.weight_bytes):.1f} MB of weights "
            f"+ {megabytes(need.kv_reserve_bytes):.1f} MB KV reserve), more than "
            f"[shard] max_memory_mb = {shard.max_memory_mb:.1f} MB")
