"""How a dense weight becomes what torch's int8 and int4 kernels take (symmetric int8 codes per output channel; uint4
codes in groups of input features with a scale and a zero each, packed in torch's CPU layout or tinygemm's tiled one
for CUDA), and the bytes each form holds; also the form a weight stored as 4-bit codes in groups arrives in
(Int4Groups: a GGUF's Q4_0, Q4_1, Q4_K blocks)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .int8_kernels import INT8_MAX

# The kernels' float32 activation paths are much slower than their bfloat16 ones (BENCHMARKS.md, "Quantized shard
# kernels").
KERNEL_DTYPE = torch.bfloat16
# torch's int4 kernels dequantize a code q as (q - 8) * scale + zero.
INT4_MIDPOINT = 8
INT4_MAX_CODE = 15
# The ranges int4_grouped_codes tries for each group: its minimum..maximum held in 15 ± k · 0.4 steps, k up to 2
# (BENCHMARKS.md "Quantized shards: quality": more, finer steps gain little for their time).
INT4_RANGE_STEPS = 2
INT4_RANGE_STEP = 0.4
_TINY = torch.finfo(torch.float32).tiny
# Weights are quantized this many output rows at a time, so the float temporaries stay small and reuse the same
# freed memory instead of growing the heap; a multiple of the int4 packing's block of 32 rows.
QUANTIZE_ROWS_PER_CHUNK = 256
INT4_PACK_ROWS = 32


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


def rows_per_chunk(rows: int) -> int:
    """How many of a weight's `rows` are quantized at a time (all at once where they are not whole packing blocks)."""
    return QUANTIZE_ROWS_PER_CHUNK if rows % INT4_PACK_ROWS == 0 else rows


def row_chunks(rows: int) -> list[tuple[int, int]]:
    """Row ranges to quantize one at a time (rows_per_chunk)."""
    step = rows_per_chunk(rows)
    return [(first, min(first + step, rows)) for first in range(0, rows, step)]


@dataclass(frozen=True)
class Int4Codes:
    """A weight rounded to int4 in the form torch's CPU int4 kernel takes: its codes as
    ``torch._convert_weight_to_int4pack_for_cpu`` packs them (two a byte, in a layout of torch's own that differs by
    torch version and CPU capability) beside the [groups, out, 2] (scale, zero) table; what a host keeps on disk of a
    weight it rounded (hearth/inference/int4_code_cache.py)."""

    packed_codes: torch.Tensor  # [out, in // 2], uint8
    scales_and_zeros: torch.Tensor  # [in // group size, out, 2], KERNEL_DTYPE

    @property
    def shape(self) -> tuple[int, int]:
        rows, pairs = self.packed_codes.shape
        return rows, 2 * pairs

    @property
    def group_size(self) -> int:
        return self.shape[1] // self.scales_and_zeros.shape[0]

    @property
    def device(self) -> torch.device:
        return self.packed_codes.device


@dataclass(frozen=True)
class Int4Groups:
    """A weight stored as 4-bit codes in groups of input features, each group with its own scale and minimum (a
    GGUF's Q4_0, Q4_1, Q4_K blocks): ``weight[r, c] = codes[r, c] * scales[r, g] + minimums[r, g]``, g = c // group."""

    codes: torch.Tensor  # [out, in], uint8 0..15
    scales: torch.Tensor  # [out, in // group size], float32
    minimums: torch.Tensor  # [out, in // group size], float32

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dequantized(self) -> torch.Tensor:
        """The float32 weight the codes stand for."""
        rows, columns = self.codes.shape
        grouped = self.codes.reshape(rows, -1, self.group_size).float()
        return (grouped * self.scales[..., None] + self.minimums[..., None]).reshape(rows, columns)

    def kernel_form(self, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows first..last as torch's int4 kernels take them: the codes, and the [groups, rows, 2] (scale, zero)
        table, zero being the value of the midpoint code."""
        scales = self.scales[first:last]
        zeros = self.minimums[first:last] + scales * INT4_MIDPOINT
        return self.codes[first:last], torch.stack([scales.t(), zeros.t()], dim=2).to(KERNEL_DTYPE).contiguous()

    def packed_for_cpu(self) -> Int4Codes:
        """These codes as torch's CPU int4 kernel takes them."""
        return packed_int4_codes(self.shape, self.group_size, self.kernel_form)


def pack_int4_for_cpu(codes: torch.Tensor) -> torch.Tensor:
    """[rows, in] codes 0..15 as torch's CPU int4 kernel takes them."""
    return torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)


def packed_int4_codes(shape: tuple[int, int], group_size: int,
                      rows_codes: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]) -> Int4Codes:
    """A weight of `shape` packed for torch's CPU int4 kernel a chunk of rows at a time (row_chunks), `rows_codes`
    giving rows first..last's codes 0..15 and their part of the (scale, zero) table."""
    rows, columns = shape
    packed = torch.empty(rows, columns // 2, dtype=torch.uint8)
    table = torch.empty(columns // group_size, rows, 2, dtype=KERNEL_DTYPE)
    for first, last in row_chunks(rows):
        codes, table[:, first:last] = rows_codes(first, last)
        packed[first:last] = pack_int4_for_cpu(codes)
    return Int4Codes(packed, table)


def int4_codes(weight: torch.Tensor, group_size: int) -> Int4Codes:
    """``int4_grouped_codes`` of ``weight``, rounded a chunk of rows at a time in float32 and packed for torch's CPU
    int4 kernel (int4_codes_of_rows of its rows)."""
    return int4_codes_of_rows(tuple(weight.shape), group_size, iter(weight.split(rows_per_chunk(weight.shape[0]))))


def int4_codes_of_rows(shape: tuple[int, int], group_size: int, chunks: Iterator[torch.Tensor]) -> Int4Codes:
    """``int4_codes`` of a weight of `shape` given as its rows, rows_per_chunk of them at a time in order (a
    checkpoint's row_chunks), so that the weight is never held whole."""
    def rows_codes(first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = next(chunks, None)
        if chunk is None or chunk.shape[0] != last - first:
            raise ValueError(f"rows {first}..{last - 1} of a {shape[0]}-row weight did not come as one chunk")
        return int4_grouped_codes(chunk.float(), group_size)

    codes = packed_int4_codes(shape, group_size, rows_codes)
    if next(chunks, None) is not None:  # also lets a checkpoint's reader finish (and count what it read)
        raise ValueError(f"more rows came than the weight's {shape[0]}")
    return codes


def pack_int4_for_cuda(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] codes 0..15 in tinygemm's tiled layout: two codes a byte (even column high), then
    ``torch._convert_weight_to_int4pack`` with the largest inner tiling the input features allow."""
    in_features = codes.shape[1]
    inner_k_tiles = next(tiles for tiles in (8, 4, 2) if in_features % (tiles * 16) == 0)
    pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).contiguous()
    return torch._convert_weight_to_int4pack(pairs, inner_k_tiles)


def int4_grouped_codes(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint4 codes [out, in] (as uint8), and the kernels' [groups, out, 2] (scale, zero) table. Each group's scale
    and zero are the least-squares fit of its values to the codes of the best of a few steps tried around its
    minimum..maximum (what llama.cpp's K-quants do: a range a little narrower or wider than the values' often rounds
    them closer, BENCHMARKS.md "Quantized shards: quality"); the codes are then rounded against the bfloat16 scale
    and zero the kernels read. Rounding otherwise is another mesh protocol, and another INT4_CODE_CACHE_FORMAT
    (hearth/inference/int4_code_cache.py)."""
    out_features, in_features = weight.shape
    values = weight.reshape(out_features, in_features // group_size, group_size)
    low = values.amin(dim=2)
    span = (values.amax(dim=2) - low).clamp(min=_TINY)
    # Fitted above the minimum, where every value lies in 0..span: the sums then lose no precision to a group's
    # offset.
    above = values - low.unsqueeze(2)
    steps_in_span = [INT4_MAX_CODE + step * INT4_RANGE_STEP for step in range(-INT4_RANGE_STEPS, INT4_RANGE_STEPS + 1)]
    # Per candidate and group: the sum of its codes, of their squares, of codes times values.
    code_sums, code_squares, cross = (torch.empty((len(steps_in_span), *low.shape), device=weight.device)
                                      for _ in range(3))
    codes = torch.empty_like(above)  # one buffer for every candidate's codes
    for index, steps in enumerate(steps_in_span):
        torch.mul(above, (steps / span).unsqueeze(2), out=codes).round_()
        if steps > INT4_MAX_CODE:  # only a range narrower than the values' rounds some of them past 15
            codes.clamp_(max=INT4_MAX_CODE)
        torch.sum(codes, dim=2, out=code_sums[index])
        torch.linalg.vecdot(codes, codes, dim=2, out=code_squares[index])
        torch.linalg.vecdot(above, codes, dim=2, out=cross[index])
    value_sums = above.sum(dim=2)
    # values ≈ scale · codes + offset by least squares leaves the values' own spread less covariance² / the codes'
    # spread: the best candidate has the largest covariance² / spread. A group whose codes are all one (constant
    # values) has no spread: it keeps minimum..maximum in 15 steps and its mean.
    count = group_size
    code_spread = code_squares - code_sums * code_sums / count
    covariance = cross - code_sums * value_sums / count
    fits = code_spread > 0
    explained = torch.where(fits, covariance * covariance / torch.where(fits, code_spread, 1), -1)
    best = torch.max(explained, dim=0, keepdim=True).indices  # argmax along the first dimension is many times slower
    code_spread, covariance, code_sum = (part.gather(0, best)[0] for part in (code_spread, covariance, code_sums))
    fitted = code_spread > 0
    scale = torch.where(fitted, covariance / torch.where(fitted, code_spread, 1), span / INT4_MAX_CODE).clamp(min=_TINY)
    offset = torch.where(fitted, (value_sums - scale * code_sum) / count, value_sums / count)
    zeros = low + offset + scale * INT4_MIDPOINT
    scales_and_zeros = torch.stack([scale.t(), zeros.t()], dim=2).to(KERNEL_DTYPE)
    held_scale = scales_and_zeros[..., 0].t().float().unsqueeze(2)
    held_zero = scales_and_zeros[..., 1].t().float().unsqueeze(2)
    torch.div(values - held_zero, held_scale, out=codes).add_(INT4_MIDPOINT).round_().clamp_(0, INT4_MAX_CODE)
    return codes.reshape(out_features, in_features).to(torch.uint8), scales_and_zeros.contiguous()
