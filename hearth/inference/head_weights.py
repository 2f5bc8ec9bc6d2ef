"""What a quantized model's lm_head is held in: int8 for a float checkpoint's, float16 for one the checkpoint stores
quantized already (a GGUF's Q8_0, Q6_K ...) on a CPU with a fast float16 product, else as loaded (BENCHMARKS.md,
"A GGUF's quantized head in float16")."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .quantization import QuantizationScheme, QuantizedLinear, head_quantization
from .weight_codes import QUANTIZE_ROWS_PER_CHUNK

# torch's CPU capabilities whose float16 one-row product reads float16 weights and sums in float32 at about the speed
# of their bytes; elsewhere (no AVX2, or a CPU where it was not measured) a float16 product may be slower than
# float32's, so a stored-quantized head stays as loaded there.
FAST_HALF_CPU_CAPABILITIES = ("AVX2", "AVX512")
# The largest |logit| a HalfPrecisionHead may produce for a row of largest magnitude 1 (its rows' absolute sums):
# below float16's largest finite value, with room for the sum's rounding.
_HALF_OUTPUT_LIMIT = 0.5 * torch.finfo(torch.float16).max
HALF_HEAD_ROWS_PER_CHUNK = 4096  # rows checked (and built from a checkpoint's rows) at a time


def half_head_supported(device: torch.device | str) -> bool:
    """Whether a stored-quantized lm_head on `device` is held in float16 (a CPU with a fast float16 product)."""
    return torch.device(device).type == "cpu" and torch.backends.cpu.get_cpu_capability() in FAST_HALF_CPU_CAPABILITIES


class HalfPrecisionHead(nn.Module):
    """An lm_head held in float16, computing each row scaled to a largest magnitude of 1 (so float16 holds it
    whatever the hidden states' scale, at the same relative precision) and giving float32 logits.

    Each logit then lies within float16's rounding of the products of the stored weights (a Q8_0 weight, an int8
    code times a float16 scale, takes up to 18 bits; float16 keeps 11), far below what the quantized layers round.
    Every row is its own one-row product, so a batch's rows round exactly as one-row products (torch's float16
    product of several rows takes about as long as as many one-row products: BENCHMARKS.md "A GGUF's quantized head
    in float16")."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """`weight`: float16 [out_features, in_features]; `bias`: float32 or None."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def of_linear(cls, linear: nn.Linear) -> HalfPrecisionHead:
        return cls(linear.weight.detach().to(torch.float16),
                   None if linear.bias is None else linear.bias.detach().float())

    @classmethod
    def of_row_chunks(cls, chunks: Iterable[np.ndarray], out_features: int, in_features: int,
                      dtype: torch.dtype) -> HalfPrecisionHead | None:
        """The head of a bias-free lm_head given as consecutive float32 row chunks (a checkpoint's row_chunks), each
        taken to the compute `dtype` and then to float16, as of_linear takes a loaded one; None as soon as a chunk
        does not fit float16. Only one chunk is ever held beside the float16 weight."""
        weight = torch.empty(out_features, in_features, dtype=torch.float16)
        done = 0
        with torch.inference_mode():
            for chunk in chunks:
                rows = torch.from_numpy(chunk).to(dtype)
                if not _rows_fit(rows):
                    return None
                weight[done:done + rows.shape[0]] = rows.to(torch.float16)
                done += rows.shape[0]
        if done != out_features:
            raise ValueError(f"the lm_head's rows came to {done}, not {out_features}")
        return cls(weight)

    @staticmethod
    def fits(linear: nn.Linear) -> bool:
        """Whether `linear`'s logits of rows scaled to 1 stay finite in float16 (each row's absolute sum bounds
        them)."""
        weight = linear.weight.detach()
        with torch.inference_mode():  # a few rows at a time: no temporary the size of the whole matrix
            return all(_rows_fit(rows) for rows in weight.split(HALF_HEAD_ROWS_PER_CHUNK))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        rows = hidden_states.reshape(-1, self.in_features)
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        scaled = (rows / scale).to(torch.float16)
        products = torch.cat([F.linear(scaled[index:index + 1], self.weight) for index in range(scaled.shape[0])])
        logits = products.to(hidden_states.dtype) * scale
        if self.bias is not None:
            logits = logits + self.bias
        return logits.reshape(*hidden_states.shape[:-1], self.out_features)


def _rows_fit(rows: torch.Tensor) -> bool:
    return float(rows.abs().sum(dim=1, dtype=torch.float32).amax()) < _HALF_OUTPUT_LIMIT


def held_head_form(lm_head: nn.Module, scheme: QuantizationScheme, device: torch.device,
                   stored_quantized: bool) -> str | None:
    """What served_lm_head holds `lm_head` (loaded or still on the meta device) in under `scheme`: "int8" (a float
    checkpoint's, on a device with a head kernel), "half" (one the checkpoint stores quantized, where
    half_head_supported: as far as its rows' magnitudes allow, HalfPrecisionHead.fits), or None (as loaded)."""
    if not scheme.quantized or type(lm_head) is not nn.Linear or head_quantization(device) is None:
        return None
    if not stored_quantized:
        return "int8"
    return "half" if half_head_supported(device) else None


def served_lm_head_of_rows(lm_head: nn.Module, scheme: QuantizationScheme, device: torch.device,
                           stored_quantized: bool,
                           row_chunks: Callable[[int], Iterator[np.ndarray]]) -> nn.Module | None:
    """The module served_lm_head would serve `lm_head` (still on the meta device) with, built from the checkpoint's
    float32 rows (`row_chunks(rows per chunk)`) a chunk at a time, so the matrix is never held whole in the compute
    dtype as loading it first would: its float16 copy, or its int8 codes (on the CPU). None where served_lm_head
    would keep it as loaded, or the rows do not fit float16 (then it loads as before)."""
    form = held_head_form(lm_head, scheme, device, stored_quantized)
    if form is None or lm_head.bias is not None:
        return None
    weight = lm_head.weight  # on the meta device: the shape, and the dtype it would load in
    if form == "half":
        return HalfPrecisionHead.of_row_chunks(row_chunks(HALF_HEAD_ROWS_PER_CHUNK), weight.shape[0],
                                               weight.shape[1], weight.dtype)
    if torch.device(device).type != "cpu":  # QuantizedLinear takes rows on the CPU only
        return None
    return QuantizedLinear(lm_head, head_quantization(device), weight_rows=(
        torch.from_numpy(chunk).to(weight.dtype) for chunk in row_chunks(QUANTIZE_ROWS_PER_CHUNK)))


def served_lm_head(lm_head: nn.Module, scheme: QuantizationScheme, device: torch.device,
                   stored_quantized: bool) -> nn.Module:
    """The module a head serves `lm_head` with under `scheme`: unchanged at full precision (or on a device where no
    head kernel beats the compute dtype); a float checkpoint's in int8 on the CPU (the head's bytes are read for every
    token, and int4 would cost its logits most); one the checkpoint stores quantized already in float16 where
    half_head_supported, since quantizing it again would round twice (BENCHMARKS.md "Quantized shards: quality")."""
    form = held_head_form(lm_head, scheme, device, stored_quantized)
    if form == "int8":
        return QuantizedLinear(lm_head, head_quantization(device))
    if form == "half" and HalfPrecisionHead.fits(lm_head):
        return HalfPrecisionHead.of_linear(lm_head)
    return lm_head
