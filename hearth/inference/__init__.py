"""hearth's inference core: load a model's layer range or head, run it with per-session KV caches, sample.

Pure compute, no network (besides resolving a hub id into the local snapshot cache). Typical use:

    runner = load_layer_range("path/or/org/name", 4, 7,          # a shard host: layers 4..7 inclusive,
                              cache_budget_bytes=budget, session_ttl_s=ttl_s)  # its KV limits ([shard] config)
    hidden = runner.forward(session_id, hidden, start_pos, "prefill" | "decode", layers=(lo, hi))

    head = load_head("path/or/org/name")                          # the orchestrator
    ids = head.encode_chat(messages) or head.encode_prompt(text)
    hidden = head.embed(ids) -> ... shards ... -> token = head.sample(head.logits(hidden), params, generator)
    delta = stream.push(token)  # stream = head.text_stream(params, ids): text deltas + stop rules

Its names are imported when first used (PEP 562), so a torch-free module of the package (the GGUF header parser,
hearth/inference/gguf_header.py) can be imported by a process that must not load torch (`hearth demo`'s parent).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Each exported name by the module that defines it.
_EXPORTED_FROM = {
    "ArchitectureAdapter": ".architectures",
    "adapter_for": ".architectures",
    "supported_architectures": ".architectures",
    "ModelInfo": ".checkpoint",
    "read_config_dict": ".checkpoint",
    "resolve_dtype": ".checkpoint",
    "resolve_model_path": ".checkpoint",
    "weights_sha256": ".checksum",
    "FINISH_LENGTH": ".detokenizer",
    "FINISH_STOP": ".detokenizer",
    "TextDelta": ".detokenizer",
    "TextStream": ".detokenizer",
    "CheckpointError": ".errors",
    "InferenceError": ".errors",
    "RunnerClosedError": ".errors",
    "SessionEvictedError": ".errors",
    "SessionStateError": ".errors",
    "SessionTooLargeError": ".errors",
    "UnsupportedArchitectureError": ".errors",
    "Head": ".head",
    "load_head": ".head_loading",
    "load_layer_range": ".loading",
    "LocalModel": ".local",
    "load_full": ".local",
    "DEFAULT_QUANTIZATION": ".quantization",
    "QuantizationError": ".quantization",
    "QuantizationScheme": ".quantization",
    "parse_quantization": ".quantization",
    "STEP_KINDS": ".runner",
    "LayerRangeRunner": ".runner",
    "SamplingParams": ".sampling",
    "sample_token": ".sampling",
    "EvictedSession": ".sessions",
}

if TYPE_CHECKING:
    from .architectures import ArchitectureAdapter, adapter_for, supported_architectures
    from .checkpoint import ModelInfo, read_config_dict, resolve_dtype, resolve_model_path
    from .checksum import weights_sha256
    from .detokenizer import FINISH_LENGTH, FINISH_STOP, TextDelta, TextStream
    from .errors import (CheckpointError, InferenceError, RunnerClosedError, SessionEvictedError, SessionStateError,
                         SessionTooLargeError, UnsupportedArchitectureError)
    from .head import Head
    from .head_loading import load_head
    from .loading import load_layer_range
    from .local import LocalModel, load_full
    from .quantization import DEFAULT_QUANTIZATION, QuantizationError, QuantizationScheme, parse_quantization
    from .runner import STEP_KINDS, LayerRangeRunner
    from .sampling import SamplingParams, sample_token
    from .sessions import EvictedSession

__all__ = [
    "DEFAULT_QUANTIZATION",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "STEP_KINDS",
    "ArchitectureAdapter",
    "CheckpointError",
    "EvictedSession",
    "Head",
    "InferenceError",
    "LayerRangeRunner",
    "LocalModel",
    "ModelInfo",
    "QuantizationError",
    "QuantizationScheme",
    "RunnerClosedError",
    "SamplingParams",
    "SessionEvictedError",
    "SessionStateError",
    "SessionTooLargeError",
    "TextDelta",
    "TextStream",
    "UnsupportedArchitectureError",
    "adapter_for",
    "load_full",
    "load_head",
    "load_layer_range",
    "parse_quantization",
    "read_config_dict",
    "resolve_dtype",
    "resolve_model_path",
    "sample_token",
    "supported_architectures",
    "weights_sha256",
]


def __getattr__(name: str):
    module = _EXPORTED_FROM.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTED_FROM})
