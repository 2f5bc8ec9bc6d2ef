"""What a layer range costs in memory before it is loaded: per-layer weight bytes read from the safetensors headers
(shapes and dtypes only, no tensor data), in the dtype the range will compute in and under its quantization scheme.

A shard refuses a range that would not fit its `[shard] max_memory_mb` before reading a weight, and `hearth host`
chooses the range that fits its budget from these figures.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch

from .checkpoint import SAFETENSORS_DTYPES, SafetensorsCheckpoint, read_config
from .checkpoint_files import opened_safetensors
from .devices import MiB
from .gguf_checkpoint import default_read_device, single_gguf_in
from .gguf_tensor_table import gguf_layer_tensors, layer_tensor_blocks
from hearth.formats.gguf_support import FLOAT_GGUF_TYPE_NAMES, SUPPORTED_GGUF_TYPE_NAMES, is_gguf_file
from .gguf_int4 import STORED_INT4_GROUP_SIZES
from .held_forms import held_as_stored, held_scheme, kept_precise, layer_precisions
from .partial_checkpoint import layer_of
from .quantization import QuantizationScheme, parse_quantization
from .sessions import kv_bytes_per_token_per_layer
from .weight_codes import int4_held_bytes, int8_held_bytes

_UNKNOWN_KIND_BYTES = 4
QUANTIZED_GGUF_TYPE_NAMES = frozenset(SUPPORTED_GGUF_TYPE_NAMES) - FLOAT_GGUF_TYPE_NAMES


def layer_weight_bytes(model_path: Path, compute_dtype: torch.dtype,
                       quantization: str | QuantizationScheme = "none", *,
                       device: torch.device | str = default_read_device) -> dict[int, int]:
    """Bytes each decoder layer's tensors take once loaded in `compute_dtype` (floating tensors are converted) and
    quantized under `quantization` (a decoder layer's floating matrices are all Linear weights: they take the
    scheme's bytes, hearth/inference/quantization.py; norms and biases stay dense) on `device` (where a GGUF's 4-bit
    weights are held as stored, and a 4-bit mix's more precise ones in int8: hearth/inference/held_forms.py)."""
    scheme = parse_quantization(quantization)
    return layer_weight_bytes_of(layer_tensor_specs(model_path), compute_dtype, scheme, device=device)


def layer_tensor_specs(model_path: Path) -> list[tuple[str, str, list[int]]]:
    """Each decoder-layer tensor's (name, stored type, shape) as layer_weight_bytes_of takes them, from a GGUF's
    tensor table (a folder holding one too) or a folder's safetensors headers (no tensor data is read)."""
    gguf_path = single_gguf_in(model_path) if model_path.is_dir() else model_path
    if gguf_path is not None and is_gguf_file(gguf_path):
        return gguf_layer_tensors(layer_tensor_blocks(gguf_path))
    checkpoint = SafetensorsCheckpoint(model_path)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, file in checkpoint.file_of.items():
        if layer_of(name) is not None:
            by_file[file].append(name)
    specs = []
    for file, names in by_file.items():
        with opened_safetensors(file) as handle:
            for name in names:
                tensor = handle.get_slice(name)
                specs.append((name, tensor.get_dtype(), tensor.get_shape()))
    return specs


def layer_weight_bytes_of(tensors: Iterable[tuple[str, str, list[int]]], compute_dtype: torch.dtype,
                          quantization: str | QuantizationScheme = "none", *,
                          device: torch.device | str = default_read_device) -> dict[int, int]:
    """layer_weight_bytes from each tensor's (name, stored type, shape), wherever they were read (a folder's
    headers, the community store's manifest, the hub's headers); the stored type is a safetensors dtype such as
    "BF16" or a GGUF block type such as "Q4_1" (read in the compute dtype, held on `device` as each layer's stored
    types make it: _held_bytes); tensors outside the decoder layers are left out."""
    scheme = parse_quantization(quantization)
    element = compute_dtype.itemsize
    tensors = list(tensors)
    precisions = layer_precisions(tensors)
    totals: dict[int, int] = defaultdict(int)
    for name, stored_dtype, shape in tensors:
        if (layer := layer_of(name)) is None:
            continue
        if stored_dtype in QUANTIZED_GGUF_TYPE_NAMES:
            totals[layer] += _held_bytes(tuple(shape), stored_dtype, scheme, element, device,
                                         precisions.get(layer, "none"))
            continue
        stored = SAFETENSORS_DTYPES.get(stored_dtype)
        if stored is None:
            element_bytes = _UNKNOWN_KIND_BYTES
        else:
            element_bytes = element if stored.is_floating_point else stored.itemsize
        if scheme.quantized and stored is not None and stored.is_floating_point and len(shape) == 2:
            size = quantized_weight_bytes(shape[0], shape[1], scheme, element)
        else:
            size = math.prod(shape) * element_bytes
        totals[layer] += size
    return dict(totals)


def weights_held_as_stored(model_path: Path, quantization: str | QuantizationScheme, *,
                           device: torch.device | str = default_read_device) -> dict[str, int]:
    """{GGUF block type: how many decoder-layer weights of it} that `quantization` holds on `device` in their stored
    4-bit form (held_as_stored: int4 of the stored groups) rather than rounding them itself; empty for a checkpoint
    that is no GGUF, and for a scheme holding none so (`none`, int4 of another group)."""
    scheme = parse_quantization(quantization)
    path = single_gguf_in(model_path) if model_path.is_dir() else model_path
    if not scheme.quantized or path is None or not is_gguf_file(path):
        return {}
    held: Counter[str] = Counter()
    for tensors in layer_tensor_blocks(path).values():
        for shape, block_type in tensors:
            group = STORED_INT4_GROUP_SIZES.get(block_type)
            if len(shape) == 2 and held_as_stored(scheme, group, shape[0], shape[1], device) is not None:
                held[block_type] += 1
    return dict(sorted(held.items()))


def weights_kept_precise(model_path: Path, quantization: str | QuantizationScheme) -> dict[str, int]:
    """{GGUF block type: how many decoder-layer weights of it} that `quantization` holds in int8 as a 4-bit mix's
    more precise matrices (held_forms.kept_precise) rather than rounding them to its 4 bits; empty for a checkpoint
    that is no GGUF, and for any scheme but int4."""
    scheme = parse_quantization(quantization)
    path = single_gguf_in(model_path) if model_path.is_dir() else model_path
    if scheme.kind != "int4" or path is None or not is_gguf_file(path):
        return {}
    tensors = gguf_layer_tensors(layer_tensor_blocks(path))
    precisions = layer_precisions(tensors)
    kept = Counter(block_type for name, block_type, shape in tensors
                   if len(shape) == 2 and kept_precise(scheme, block_type, precisions[layer_of(name)]) is not None)
    return dict(sorted(kept.items()))


def weights_rounded_again(model_path: Path, quantization: str | QuantizationScheme, *,
                          device: torch.device | str = default_read_device) -> dict[str, int]:
    """{GGUF block type: how many decoder-layer weights of it} stored quantized that `quantization` rounds again
    into its own codes on `device` (rounded_again_of); empty for a checkpoint that is no GGUF, and for `none`."""
    path = single_gguf_in(model_path) if model_path.is_dir() else model_path
    if path is None or not is_gguf_file(path):
        return {}
    return rounded_again_of(gguf_layer_tensors(layer_tensor_blocks(path)), quantization, device=device)


def rounded_again_of(tensors: Iterable[tuple[str, str, list[int]]], quantization: str | QuantizationScheme, *,
                     device: torch.device | str = default_read_device) -> dict[str, int]:
    """{block type: how many} of the decoder-layer weights among `tensors` ((name, stored type, shape)) stored in
    quantized blocks that `quantization` rounds again into its own codes on `device`: no rule of
    hearth/inference/held_forms.py holds them otherwise (an I-quant, Q2_K or Q3_K under int4, a 5- to 8-bit block
    under int8); empty for `none`."""
    scheme = parse_quantization(quantization)
    if not scheme.quantized:
        return {}
    tensors = list(tensors)
    precisions = layer_precisions(tensors)
    again = Counter(block_type for name, block_type, shape in tensors
                    if len(shape) == 2 and (layer := layer_of(name)) is not None
                    and block_type in QUANTIZED_GGUF_TYPE_NAMES
                    and held_scheme(scheme, block_type, shape, precisions[layer], device) is None)
    return dict(sorted(again.items()))


def _held_bytes(shape: tuple[int, ...], block_type: str, scheme: QuantizationScheme, element: int,
                device: torch.device | str, layer_precision: str) -> int:
    # A GGUF's layer tensors are dequantized to the compute dtype (hearth/inference/gguf_checkpoint.py): its 2-D ones
    # are the Linear weights the scheme quantizes again, but those held_forms.py holds otherwise.
    if not scheme.quantized or len(shape) != 2:
        return math.prod(shape) * element
    held = held_scheme(scheme, block_type, shape, layer_precision, device)
    return quantized_weight_bytes(shape[0], shape[1], held or scheme, element)


def quantized_weight_bytes(out_features: int, in_features: int, scheme: QuantizationScheme,
                           dense_element_bytes: int) -> int:
    """Bytes a Linear weight of that shape takes under ``scheme`` (codes plus scales and zeros); the dense size
    for "none"."""
    if scheme.kind == "int8":
        return int8_held_bytes(out_features, in_features)
    if scheme.kind == "int4":
        return int4_held_bytes(out_features, in_features, scheme.group_size)
    return out_features * in_features * dense_element_bytes


def range_weight_bytes(per_layer: dict[int, int], lo: int, hi: int) -> int:
    """Weight bytes of layers lo..hi (inclusive)."""
    return sum(per_layer.get(index, 0) for index in range(lo, hi + 1))


def full_context_session_kv_bytes(model_path: Path, lo: int, hi: int, dtype: torch.dtype) -> int | None:
    """The KV-cache bytes one session holds in layers lo..hi at the model's whole context (keys and values of every
    KV head in `dtype` at every position), from the checkpoint's config alone; None when it names no context. No
    session's cache grows past it: a step beyond the context is refused (sliding-window layers hold less, a static
    cache no more than its positions, at most the context)."""
    config = read_config(model_path)
    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    if not context:
        return None
    # The runner's own figure (runner.py), from the same config.
    return context * kv_bytes_per_token_per_layer(config, dtype) * (hi - lo + 1)


def megabytes(num_bytes: float) -> float:
    return round(num_bytes / MiB, 3)


def shown_mb(num_bytes: float) -> str:
    """`num_bytes` in MB as a message shows it: one decimal from 1 MB, three significant digits below (one decimal
    showed a budget of 0.01 MB as "0.0 MB")."""
    value = num_bytes / MiB
    return f"{value:.1f}" if value >= 1 else f"{value:.3g}"
