"""The int8 products of quantized Linears whose activations are quantized too, each row on its own scale: on the CPU
fbgemm's int8 GEMM, on CUDA cuBLASLt's; both accumulate exactly in int32, so a row's result never depends on its
batch.

Why fbgemm on the CPU (BENCHMARKS.md "Quantized shard kernels"): its int8 product runs a prefill's rows in a good
deal less time than torch's weight-only int8 kernel (a matrix-vector one) and a decode row faster on one thread,
at least as close to the int8 weights' exact product. fbgemm's own dynamic Linear quantizes a whole product's
activations on one scale (a row would round differently alone, batched or in a prefill); hearth hands it fixed
scales instead and quantizes each row itself:
- a row is rounded to bfloat16 (as the weight-only kernels take it: the last-bit differences between a batched and
  a solo step's attention then mostly vanish here instead of reaching the residual stream), divided by its largest
  magnitude over 63 and rounded: codes -63..63;
- what the codes leave (at most half a step) is scaled by 126 into the same range and rounded again, and both
  levels go through one product as two rows, so activations carry about 13 bits, where one 7-bit level alone lost
  several points of top-1 agreement on a trained model.
Codes stay within 7 bits (1..127 around fbgemm's zero point 64), as torch's dynamic quantization does on x86: AVX2's
int8 multiply-add saturates pairs of 8-bit products in 16 bits. Linears reading one input share one packed product
(fbgemm_shared_product). torch deprecates its quantized tensors; where this
torch has no fbgemm engine or no such operator, int8 keeps the weight-only kernel (int8_rows_on_cpu says which).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Sequence

import torch

from .shared_products import SharedRowProduct

INT8_MAX = 127
# Activation codes -63..63 around fbgemm's zero point 64: 7 bits; the second level scales a remainder of at most
# half a step by 126 into the same range (see the module docstring).
_ROW_ACTIVATION_ZERO = 64
_ROW_CODE_STEPS = 63
_FINE_LEVEL = 2 * _ROW_CODE_STEPS
# The same numbers as float32 tensors: an operation given a Python number wraps it in a tensor on every call.
_CODE_STEPS, _FINE_FACTOR = torch.tensor(float(_ROW_CODE_STEPS)), torch.tensor(float(_FINE_LEVEL))
_TINY = torch.tensor(torch.finfo(torch.float32).tiny)
_FBGEMM_ENGINE = "fbgemm"
# cuBLASLt's int8 product takes more than 16 rows: fewer are padded (to a multiple of 8, which it also needs).
INT_MM_MIN_ROWS = 24
INT_MM_FEATURE_MULTIPLE = 8


@functools.cache
def int8_rows_on_cpu() -> bool:
    """Whether this torch runs int8 Linears on fbgemm with activations quantized per row (else weight-only)."""
    return (_FBGEMM_ENGINE in torch.backends.quantized.supported_engines
            and hasattr(torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32"))


def pack_for_fbgemm(codes: torch.Tensor, scales: torch.Tensor) -> torch.ScriptObject:
    """fbgemm's packed form of int8 ``codes`` [out, in] with one ``scales`` entry per output row (symmetric)."""
    zero_points = torch.zeros(codes.shape[0], dtype=torch.long)
    with warnings.catch_warnings(), _quantized_engine(_FBGEMM_ENGINE):
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*deprecated")
        weight = torch._make_per_channel_quantized_tensor(codes, scales.double(), zero_points, 0)
        return torch.ops.quantized.linear_prepack(weight, None)


def fbgemm_row_product(rows: torch.Tensor, packed: torch.ScriptObject) -> torch.Tensor:
    """``rows @ (codes * scales)^T`` in float32, each row (rounded to bfloat16) on its own largest magnitude in two
    7-bit levels: its codes, then what they leave, as two rows of one product (see the module docstring)."""
    return _product_of_rounded(rows.to(torch.bfloat16, copy=True), packed)


def fbgemm_shared_product(codes: torch.Tensor, scales: torch.Tensor, widths: Sequence[int]) -> SharedRowProduct:
    """One product of the members' int8 ``codes`` and ``scales`` one after another (``widths`` rows each, the same
    input features), packed once."""
    packed = pack_for_fbgemm(codes, scales)
    return SharedRowProduct(lambda rounded: _product_of_rounded(rounded, packed), widths)


def _product_of_rounded(rounded: torch.Tensor, packed: torch.ScriptObject) -> torch.Tensor:
    count = rounded.shape[0]
    levels, steps = _row_levels(rounded)
    product = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        levels, 1.0, _ROW_ACTIVATION_ZERO, packed)
    return torch.add(product[:count], product[count:], alpha=1.0 / _FINE_LEVEL).mul_(steps)


def _row_levels(rounded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two levels of bfloat16 ``rounded`` as fbgemm's input rows (codes first, then what they leave, scaled),
    and each row's step; written into one buffer with few operations, as for one row they take about as long as the
    product itself."""
    count = rounded.shape[0]
    levels = torch.empty(2 * count, rounded.shape[1])
    codes, rest = levels[:count], levels[count:]
    codes.copy_(rounded)
    steps = codes.abs().amax(dim=1, keepdim=True).clamp_min_(_TINY).div_(_CODE_STEPS)
    torch.div(codes, steps, out=rest)
    torch.round(rest, out=codes)
    rest.sub_(codes).mul_(_FINE_FACTOR)
    return levels, steps


def cuda_row_product(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``rows @ (codes * scales)^T`` on ``torch._int_mm``: each row quantized to int8 on its own largest magnitude,
    padded with zero rows to the count the int8 product needs."""
    count = rows.shape[0]
    if count < INT_MM_MIN_ROWS:
        rows = torch.cat([rows, rows.new_zeros(INT_MM_MIN_ROWS - count, rows.shape[1])])
    wide = rows.float()
    row_scales = wide.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
    activations = torch.round(wide / row_scales).to(torch.int8)
    product = torch._int_mm(activations, codes.t())[:count]
    return product.float() * row_scales[:count] * scales.float()


@contextlib.contextmanager
def _quantized_engine(engine: str):
    """torch's quantized engine set to ``engine`` while packing: the packed form follows the engine, the product
    then follows the packed form."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        yield
    finally:
        torch.backends.quantized.engine = before
