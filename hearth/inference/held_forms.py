"""What each Linear weight of a decoder layer is held in under a scheme, given how the checkpoint stores it: most
follow the scheme, but a GGUF's 4-bit groups are held as they are and a 4-bit mix's more precise matrices in int8.

Two rules keep a weight from being rounded again into fewer bits than it is stored in, or into more bits than it
holds (BENCHMARKS.md "Quantized shards: quality"):
- held as stored (held_as_stored): a weight stored as 4-bit codes in groups (Q4_0, Q4_1, Q4_K) is held in int4 of
  its groups under int8 (whose rounding would only add bits to it) and under int4 of its own group;
- kept precise (kept_precise): in a layer whose matrices are mostly stored in 4 bits or fewer (llama.cpp's Q4_K_M,
  Q3_K_M ... mixes), a matrix stored in 5 to 8 bits (Q5_*, Q6_K, Q8_0: the mix's choice for the weights that need
  it most, attn_v and ffn_down of some layers) is held in int8 under int4 rather than rounded to 4 bits. Where a
  layer is mostly 5- to 8-bit (a Q8_0 file) int4 rounds every matrix, as asked.
Both depend only on the checkpoint, the scheme and the device, so every host of one file holds the same weights
under one scheme, and a layer's rule on its own tensors, so a range fetched alone holds what the whole file does.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable

import torch

from .gguf_int4 import STORED_INT4_GROUP_SIZES
from .partial_checkpoint import layer_of
from .quantization import INT4_GROUP_SIZES, QUANTIZATION_KINDS, QuantizationError, QuantizationScheme, \
    check_device_supports, int4_shape_problem

# The scheme each stored type of a layer's matrices matches: 4-bit blocks and below int4 (the I-quants too, whose
# codebooks int4's even steps cannot hold: rounded again, BENCHMARKS.md "Files llama.cpp wrote"), 5- to 8-bit
# blocks int8, floats (a GGUF's F32/F16/BF16, any safetensors dtype) none.
_INT4_STORED_TYPES = frozenset({"Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S",
                                "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS"})
_INT8_STORED_TYPES = frozenset({"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"})
KEPT_PRECISE_SCHEME = QuantizationScheme("int8")


def stored_type_precision(stored_type: str) -> str:
    """The scheme label a matrix stored as `stored_type` matches (a GGUF block type name such as "Q4_K", or a
    safetensors dtype such as "BF16": full precision)."""
    if stored_type in _INT4_STORED_TYPES:
        return "int4"
    if stored_type in _INT8_STORED_TYPES:
        return "int8"
    return "none"


def stored_precision(tensors: Iterable[tuple[str, str, list[int]]]) -> str:
    """The label of the precision that holds most of the decoder layers' matrix elements, of tensors given as (name,
    stored type, shape) as hearth/inference/memory.py's layer_weight_bytes_of takes them; a tie goes to the more
    precise, and tensors without layer matrices are `none`."""
    elements: Counter[str] = Counter()
    for name, stored_type, shape in tensors:
        if len(shape) == 2 and layer_of(name) is not None:  # norms and biases are held dense by every scheme
            elements[stored_type_precision(stored_type)] += math.prod(shape)
    if not elements:
        return "none"
    return min(elements, key=lambda label: (-elements[label], QUANTIZATION_KINDS.index(label)))


def layer_precisions(tensors: Iterable[tuple[str, str, list[int]]]) -> dict[int, str]:
    """stored_precision of each decoder layer on its own, by layer index."""
    by_layer: dict[int, list[tuple[str, str, list[int]]]] = defaultdict(list)
    for name, stored_type, shape in tensors:
        if (layer := layer_of(name)) is not None:
            by_layer[layer].append((name, stored_type, shape))
    return {layer: stored_precision(layer_tensors) for layer, layer_tensors in by_layer.items()}


def held_as_stored(scheme: QuantizationScheme, stored_int4_group: int | None, out_features: int, in_features: int,
                   device: torch.device | str) -> QuantizationScheme | None:
    """The int4 scheme to hold, as stored, a Linear weight stored as 4-bit codes in groups of ``stored_int4_group``
    inputs: under int8 (more bits than stored) or int4 of that group, where device and shape have the int4 kernel;
    None when it follows ``scheme`` (stored otherwise, "none", or int4 of another group: the group asked for)."""
    if stored_int4_group is None or not scheme.quantized or stored_int4_group not in INT4_GROUP_SIZES:
        return None
    stored = QuantizationScheme("int4", stored_int4_group)
    if scheme.kind == "int4" and scheme != stored:
        return None
    try:
        check_device_supports(stored, device)
    except QuantizationError:
        return None
    return None if int4_shape_problem(out_features, in_features, stored) else stored


def kept_precise(scheme: QuantizationScheme, stored_type: str, layer_precision: str) -> QuantizationScheme | None:
    """KEPT_PRECISE_SCHEME for a matrix stored as `stored_type` (5 to 8 bits) under int4 in a layer whose
    stored_precision is int4 (a 4-bit mix); None when it follows ``scheme``."""
    if scheme.kind != "int4" or layer_precision != "int4" or stored_type_precision(stored_type) != "int8":
        return None
    return KEPT_PRECISE_SCHEME


def held_scheme(scheme: QuantizationScheme, stored_type: str, shape: tuple[int, ...] | list[int],
                layer_precision: str, device: torch.device | str) -> QuantizationScheme | None:
    """The scheme a layer matrix stored as `stored_type` of `shape` is held in under ``scheme`` on `device`, in a
    layer of `layer_precision`, where a rule above holds it otherwise; None where it follows ``scheme``."""
    if len(shape) != 2:
        return None
    return (held_as_stored(scheme, STORED_INT4_GROUP_SIZES.get(stored_type), shape[0], shape[1], device)
            or kept_precise(scheme, stored_type, layer_precision))
