"""What a layer range costs in memory before it is loaded: per-layer weight bytes read from the safetensors headers
(shapes and dtypes only, no tensor data), in the dtype the range will compute in and under its quantization scheme.

A shard refuses a range that would not fit its `shard_max_memory_mb` before reading a weight, and `hearth host`
chooses the range that fits its budget from these figures.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from .checkpoint import SAFETENSORS_DTYPES, SafetensorsCheckpoint
from .quantization import QuantizationScheme, parse_quantization, quantized_weight_bytes

_layer_name_re = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_UNKNOWN_KIND_BYTES = 4
MiB = 1024 * 1024


def layer_weight_bytes(model_path: Path, compute_dtype: torch.dtype,
                       quantization: str | QuantizationScheme = "none") -> dict[int, int]:
    """Bytes each decoder layer's tensors take once loaded in `compute_dtype` (floating tensors are converted) and
    quantized under `quantization` (a decoder layer's floating matrices are all Linear weights: they take the
    scheme's bytes, inference/quantization.py; norms and biases stay dense)."""
    scheme = parse_quantization(quantization)
    checkpoint = SafetensorsCheckpoint(model_path)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, file in checkpoint.file_of.items():
        if _layer_name_re.search(name):
            by_file[file].append(name)
    element = torch.empty((), dtype=compute_dtype).element_size()
    totals: dict[int, int] = defaultdict(int)
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as handle:
            for name in names:
                tensor = handle.get_slice(name)
                stored = SAFETENSORS_DTYPES.get(tensor.get_dtype())
                shape = tensor.get_shape()
                if stored is None:
                    element_bytes = _UNKNOWN_KIND_BYTES
                else:
                    element_bytes = element if stored.is_floating_point else stored.itemsize
                if scheme.quantized and stored is not None and stored.is_floating_point and len(shape) == 2:
                    size = quantized_weight_bytes(shape[0], shape[1], scheme, element)
                else:
                    size = math.prod(shape) * element_bytes
                totals[int(_layer_name_re.search(name).group(1))] += size
    return dict(totals)


def range_weight_bytes(per_layer: dict[int, int], lo: int, hi: int) -> int:
    """Weight bytes of layers lo..hi (inclusive)."""
    return sum(per_layer.get(index, 0) for index in range(lo, hi + 1))


def megabytes(num_bytes: float) -> float:
    return round(num_bytes / MiB, 3)
