"""Which scheme `--quantize auto` serves a checkpoint in: the precision holding most of its decoder layers' weights as
stored (a GGUF's block types; a safetensors checkpoint's floats), on a device that has a kernel for it.

A household's GGUF of 4-bit blocks is what it would run with llama.cpp or Ollama at 4 bits: served as `none` it
would be dequantized to full precision, four to eight times the memory and slower (BENCHMARKS.md, "`hearth demo`").
A part of a GGUF (a layer range fetched from the community store or the hub) resolves from its own layers: llama.cpp's
mixes hold the same majority in every layer (Q4_K_M keeps attn_v and ffn_down of some layers in Q6_K, under a third
of such a layer's elements, and int4 holds those in int8: hearth/inference/held_forms.py), so the hosts of one file
resolve one scheme and their ranges form one pipeline (which never mixes schemes). A head's part holds no layer: its
lm_head is held as its own weight is stored (resolved_head_scheme).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from .held_forms import stored_precision
from .memory import layer_tensor_specs
from .quantization import AUTO_QUANTIZATION, HEAD_QUANTIZATION, QuantizationError, QuantizationScheme, \
    check_device_supports, parse_quantization

# Where a device has no kernel for what a checkpoint stores, auto takes the next more precise scheme.
_MORE_PRECISE = {"int4": "int8", "int8": "none"}


def checkpoint_precision(model_path: Path) -> str:
    """stored_precision of a local checkpoint (a folder, a GGUF file or a folder holding one), from its headers."""
    return stored_precision(layer_tensor_specs(model_path))


def resolved_scheme(setting: str | QuantizationScheme | None,
                    checkpoint: str | Path | Iterable[tuple[str, str, list[int]]],
                    device: torch.device | str) -> QuantizationScheme:
    """The scheme a `--quantize` setting serves on `device`: AUTO_QUANTIZATION resolved from `checkpoint` (a local
    checkpoint's path: checkpoint_precision; its layer tensors as (name, stored type, shape): stored_precision) and,
    where `device` has no kernel for that, the next more precise scheme it has one for; anything else as
    parse_quantization reads it (whether `device` runs a scheme named outright is check_device_supports')."""
    if setting != AUTO_QUANTIZATION:
        return parse_quantization(setting)
    label = checkpoint_precision(Path(checkpoint)) if isinstance(checkpoint, (str, Path)) \
        else stored_precision(checkpoint)
    return _runnable_from(label, device)


def resolved_head_scheme(setting: str | QuantizationScheme | None, stored_quantized: bool,
                         device: torch.device | str) -> QuantizationScheme:
    """The scheme an lm_head is served under (hearth/inference/head_weights.py's served_lm_head): AUTO_QUANTIZATION
    quantized (HEAD_QUANTIZATION) where the checkpoint stores the head's weight quantized, so that it is held in
    float16 rather than dequantized to full precision, and full precision where it stores floats; on its own weight,
    as a head's part of a GGUF holds no layer to resolve from. Anything else as parse_quantization reads it."""
    if setting != AUTO_QUANTIZATION:
        return parse_quantization(setting)
    return _runnable_from(HEAD_QUANTIZATION.label if stored_quantized else "none", device)


def _runnable_from(label: str, device: torch.device | str) -> QuantizationScheme:
    """The scheme `label` names where `device` has a kernel for it, else the next more precise one it has."""
    while True:
        scheme = parse_quantization(label)
        try:
            check_device_supports(scheme, device)
            return scheme
        except QuantizationError:
            if label not in _MORE_PRECISE:
                raise
            label = _MORE_PRECISE[label]
