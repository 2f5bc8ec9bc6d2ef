"""How a dense weight becomes what torch's int8 and int4 kernels take (symmetric int8 codes per output channel; uint4
codes in groups of input features with a scale and a zero each, and tinygemm's tiled layout for CUDA), and the
bytes each form holds."""

from __future__ import annotations

import torch

from .int8_kernels import INT8_MAX

# The kernels' float32 activation paths are much slower than their bfloat16 ones (BENCHMARKS.md, "Quantized shard
# kernels").
KERNEL_DTYPE = torch.bfloat16
# torch's int4 kernels dequantize a code q as (q - 8) * scale + zero.
INT4_MIDPOINT = 8
INT4_MAX_CODE = 15


def int8_held_bytes(out_features: int, in_features: int) -> int:
    """Bytes of an int8 weight: its codes and one scale per output row."""
    return out_features * in_features + out_features * KERNEL_DTYPE.itemsize


def int4_held_bytes(out_features: int, in_features: int, group_size: int) -> int:
    """Bytes of an int4 weight: two codes a byte and a (scale, zero) pair per group of each output row."""
    return out_features * in_features // 2 + in_features // group_size * out_features * 2 * KERNEL_DTYPE.itemsize


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes and one scale per output row (the row's largest magnitude maps to 127)."""
    scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
    codes = torch.clamp(torch.round(weight / scales[:, None]), -INT8_MAX, INT8_MAX).to(torch.int8)
    return codes.contiguous(), scales


def pack_int4_for_cuda(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] codes 0..15 in tinygemm's tiled layout: two codes a byte (even column high), then
    ``torch._convert_weight_to_int4pack`` with the largest inner tiling the input features allow."""
    in_features = codes.shape[1]
    inner_k_tiles = next(tiles for tiles in (8, 4, 2) if in_features % (tiles * 16) == 0)
    pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).contiguous()
    return torch._convert_weight_to_int4pack(pairs, inner_k_tiles)


def int4_grouped_codes(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint4 codes [out, in] (as uint8), and the kernels' [groups, out, 2] (scale, zero) table; each group of input
    features spans its own minimum..maximum."""
    out_features, in_features = weight.shape
    grouped = weight.reshape(out_features, in_features // group_size, group_size)
    low, high = grouped.amin(dim=2), grouped.amax(dim=2)
    scales = ((high - low) / INT4_MAX_CODE).clamp(min=torch.finfo(torch.float32).tiny)
    zeros = low + scales * INT4_MIDPOINT
    codes = torch.clamp(torch.round((grouped - low[..., None]) / scales[..., None]), 0, INT4_MAX_CODE)
    scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=2).to(KERNEL_DTYPE).contiguous()
    return codes.reshape(out_features, in_features).to(torch.uint8), scales_and_zeros
