"""A GGUF's model config as the file states it: what transformers' GGUF config reader leaves out (a head size of its
own, RoPE scaling, Phi-3's LongRoPE and partial rotary embedding, Gemma 2's soft caps and attention scale, Gemma 3's
local and global layers) read from the file's metadata and its rope_freqs / rope_factors tensors; what hearth cannot
express in a transformers config is refused in one line, never served with another model's positions.

llama.cpp's converter stores Llama 3's RoPE scaling as a tensor, `rope_freqs.weight`, one divisor per rotary
frequency, and no metadata: the config's `llama3` parameters are recovered from those divisors (Meta's low and high
frequency factors, 1 and 4, which every Llama 3 model and the converter's defaults use; the original context from
the divisors between them) and checked by computing the divisors back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from .errors import CheckpointError
from .gguf_header import read_gguf_header
from .gguf_layout import LONGROPE_TENSORS, ROPE_FREQS_TENSOR

EMBEDDING_TENSOR = "token_embd.weight"
# What llama.cpp's converter puts in the name of every tensor holding a layer's experts (ffn_gate_exps, ...).
EXPERT_TENSOR_MARK = "_exps."
# YaRN keys a GGUF may state that hearth reads only at the values that leave llama.cpp's YaRN transformers' (an
# extrapolation factor of -1 is llama.cpp's "unset").
YARN_NEUTRAL_VALUES = {"yarn_ext_factor": (1.0, -1.0), "yarn_attn_factor": (1.0,), "yarn_log_multiplier": (0.0,),
                       "attn_factor": (1.0,)}
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
# The converter's default when a Llama 3 config names none; used only when no divisor lies between the bounds.
LLAMA3_DEFAULT_ORIGINAL_CONTEXT = 8192
# How far divisors computed back from the recovered parameters may lie from the stored float32 ones.
ROPE_DIVISOR_RTOL = 1e-4
# llama.cpp tells Gemma 2's sizes apart by their layers; its 27B scales queries by hidden size / heads, the others
# by the head size.
GEMMA2_27B_LAYERS = 46
GEMMA2_SOFTCAP_KEYS = ("attn_logit_softcapping", "final_logit_softcapping")
# What llama.cpp assumes of every Gemma 3 GGUF, which states none of it: five local (sliding-window) layers to one
# global layer, local layers rotating on base 10 000 without scaling (the file's base and scaling are the global
# layers'), and its 27B (62 layers) scaling queries by hidden size / heads.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_GLOBAL_ROPE_THETA = 1_000_000.0
GEMMA3_27B_LAYERS = 62
# Gemma 3 4B, 12B and 27B scale their global layers' RoPE linearly by 8 to reach a 131 072-token context; Ollama's
# converter wrote neither, and its files are told apart by metadata of their own (_is_ollama_gemma3).
GEMMA3_SCALED_CONTEXT = 131072
GEMMA3_OLLAMA_LINEAR_FACTOR = 8.0
# Keys (after the architecture's name) this module reads as numbers; a file stating one as anything but a finite
# number is refused rather than read (_check_numbers).
NUMERIC_KEYS = ("attention.key_length", "attention.value_length", "attention.sliding_window", "expert_count",
                "rope.dimension_count", "rope.freq_base", "rope.freq_base_swa", "rope.global.freq_base",
                "rope.local.freq_base", "rope.scaling.factor", "rope.scaling.original_context_length",
                "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
                *(f"rope.scaling.{key}" for key in YARN_NEUTRAL_VALUES), *GEMMA2_SOFTCAP_KEYS)
OLLAMA_GEMMA3_KEYS = ("gemma3.rope.global.freq_base", "gemma3.rope.local.freq_base", "gemma3.mm.tokens_per_image",
                      "tokenizer.ggml.add_padding_token", "tokenizer.ggml.add_unknown_token")


def completed_gguf_config(config: dict, architecture: str, metadata: Mapping[str, object], tensor_names: set[str],
                          read_f32_tensor: Callable[[str], np.ndarray], file_name: str) -> dict:
    """`config` (transformers' reading of the GGUF's metadata, as a dict) with what it leaves out filled in from
    `metadata` (the GGUF's scalar key/values) and the tensors `tensor_names` lists (`read_f32_tensor(name)` reads
    one stored as F32); CheckpointError (one line) for what hearth cannot express."""
    config = dict(config)
    _check_numbers(architecture, metadata, file_name)
    _check_dense(architecture, metadata, tensor_names, file_name)
    _use_head_size(config, architecture, metadata, file_name)
    if architecture == "phi3":
        rope = _phi3_rope_parameters(config, metadata, tensor_names, read_f32_tensor, file_name)
    elif architecture == "gemma3":
        _check_full_rotary(config, architecture, metadata, file_name)
        rope = _gemma3_layers(config, metadata, tensor_names, read_f32_tensor, file_name)
    else:
        _check_full_rotary(config, architecture, metadata, file_name)
        rope = _rope_parameters(config, architecture, metadata, tensor_names, read_f32_tensor, file_name)
    if rope is not None:
        config["rope_parameters"] = rope
    if architecture == "gemma2":
        for key in GEMMA2_SOFTCAP_KEYS:
            if (value := metadata.get(f"gemma2.{key}")) is not None:
                config[key] = float(value)
        config["query_pre_attn_scalar"] = _gemma_query_scale(config, GEMMA2_27B_LAYERS)
    if architecture == "gemma3":
        # Ollama's converter stated a cap of 30 that no Gemma 3 has (its runtime drops it, as hearth does).
        softcap = None if _is_ollama_gemma3(metadata) else metadata.get("gemma3.final_logit_softcapping")
        if softcap is not None:
            config["final_logit_softcapping"] = float(softcap)
        config["query_pre_attn_scalar"] = _gemma_query_scale(config, GEMMA3_27B_LAYERS)
    if architecture == "phi3" and (window := metadata.get("phi3.attention.sliding_window")):
        config["sliding_window"] = int(window)
    return config


def _check_numbers(architecture: str, metadata: Mapping[str, object], file_name: str) -> None:
    for key in (f"{architecture}.{suffix}" for suffix in NUMERIC_KEYS):
        value = metadata.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise CheckpointError(f"GGUF {file_name} states {key} as {value!r}, not a finite number")


def _check_dense(architecture: str, metadata: Mapping[str, object], tensor_names: set[str], file_name: str) -> None:
    """Refuse a mixture-of-experts GGUF: Mixtral's files are written as `llama` with experts, which transformers'
    config reader does not see, and hearth's layers, kernels and memory figures are those of dense models."""
    experts = metadata.get(f"{architecture}.expert_count")
    stated = isinstance(experts, int) and experts > 0
    expert_tensors = sorted(name for name in tensor_names if EXPERT_TENSOR_MARK in name)
    if stated or expert_tensors:
        what = f"{experts} experts a layer" if stated else f"expert tensors such as {expert_tensors[0]}"
        raise CheckpointError(f"GGUF {file_name} is a mixture-of-experts {architecture} model ({what}; Mixtral's "
                              "GGUFs are written as llama): hearth serves dense models only")


def _gemma_query_scale(config: dict, layers_of_27b: int) -> int:
    """Gemma's query_pre_attn_scalar by llama.cpp's rule: hidden size / heads for the 27B, told by its layers;
    the head size for every other size."""
    if config["num_hidden_layers"] == layers_of_27b:
        return config["hidden_size"] // config["num_attention_heads"]
    return _head_size(config)


def _head_size(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _use_head_size(config: dict, architecture: str, metadata: Mapping[str, object], file_name: str) -> None:
    keys, values = (metadata.get(f"{architecture}.attention.{kind}_length") for kind in ("key", "value"))
    if keys is None:
        return
    if values is not None and values != keys:
        raise CheckpointError(f"GGUF {file_name} has keys of {keys} and values of {values} dimensions per head; "
                              "hearth serves models whose keys and values are the same size")
    config["head_dim"] = int(keys)


def _check_full_rotary(config: dict, architecture: str, metadata: Mapping[str, object], file_name: str) -> None:
    rotary = metadata.get(f"{architecture}.rope.dimension_count")
    if rotary is not None and rotary != _head_size(config):
        raise CheckpointError(f"GGUF {file_name} rotates {rotary} of each head's {_head_size(config)} dimensions "
                              "(a partial rotary embedding), which hearth does not read from GGUF files")


def _phi3_rope_parameters(config: dict, metadata: Mapping[str, object], tensor_names: set[str],
                          read_f32_tensor: Callable[[str], np.ndarray], file_name: str) -> dict | None:
    """Phi-3's rope_parameters: a partial rotary embedding (Phi-4-mini) as its `partial_rotary_factor`, and LongRoPE
    (Phi-3.5, Phi-4-mini, the 128k Phi-3s) from the converter's `rope_factors_long`/`_short` tensors, the original
    context and, where it is not the one transformers derives, the attention factor; None when neither applies."""
    base = dict(config.get("rope_parameters") or {})
    head, rotary = _head_size(config), metadata.get("phi3.rope.dimension_count")
    rope = dict(base)
    if rotary is not None and rotary != head:
        if not 0 < rotary < head or rotary % 2:
            raise CheckpointError(f"GGUF {file_name} rotates {rotary} of each head's {head} dimensions")
        rope["partial_rotary_factor"] = rotary / head
    rotary = int(rotary or head)
    scaling = metadata.get("phi3.rope.scaling.type")
    held = tensor_names.intersection(LONGROPE_TENSORS)
    # A file of metadata alone (a hub GGUF's header, read to size a range) holds no tensor to judge.
    if scaling not in (None, "none", "longrope", "su") or (scaling in ("longrope", "su") and not held and tensor_names):
        raise CheckpointError(f"GGUF {file_name} scales its RoPE as {scaling!r}, which hearth does not read from "
                              "GGUF files for Phi-3 (it reads LongRoPE's factor tensors)")
    if held:
        if len(held) != len(LONGROPE_TENSORS):
            raise CheckpointError(f"GGUF {file_name} holds {', '.join(sorted(held))} without its pair")
        long, short = (read_f32_tensor(name).astype(np.float64).tolist() for name in LONGROPE_TENSORS)
        original = metadata.get("phi3.rope.scaling.original_context_length")
        if len(long) != rotary // 2 or len(short) != rotary // 2 or not isinstance(original, int) or original <= 0:
            raise CheckpointError(f"GGUF {file_name}'s LongRoPE factors are not one per rotary frequency "
                                  f"({rotary // 2}) with an original context")
        rope.update(rope_type="longrope", long_factor=long, short_factor=short)
        config["original_max_position_embeddings"] = original
        stated = metadata.get("phi3.rope.scaling.attn_factor")
        scale = config["max_position_embeddings"] / original
        derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        if isinstance(stated, (int, float)) and not math.isclose(stated, derived, rel_tol=ROPE_DIVISOR_RTOL):
            rope["attention_factor"] = float(stated)
    return rope if rope != base else None


def _gemma3_layers(config: dict, metadata: Mapping[str, object], tensor_names: set[str],
                   read_f32_tensor: Callable[[str], np.ndarray], file_name: str) -> dict:
    """Gemma 3's layer types and its rope_parameters per layer type, as llama.cpp reads the file: with a sliding
    window, every sixth layer global and the rest local (or as a stated pattern says); without one, every layer
    global. Ollama's conversions name the bases differently and leave out the 4B-27B's scaling, which llama.cpp's
    Ollama compatibility restores the same way."""
    layers = int(config["num_hidden_layers"])
    window, pattern = metadata.get("gemma3.attention.sliding_window"), metadata.get(
        "gemma3.attention.sliding_window_pattern")
    if not (isinstance(window, int) and window > 0):
        config["sliding_window"], local = None, [False] * layers
    elif isinstance(pattern, list) and len(pattern) == layers:
        config["sliding_window"], local = window, [bool(is_local) for is_local in pattern]
    else:
        every = pattern if isinstance(pattern, int) and pattern > 0 else GEMMA3_SLIDING_WINDOW_PATTERN
        config["sliding_window"], local = window, [bool((layer + 1) % every) for layer in range(layers)]
    config["layer_types"] = ["sliding_attention" if is_local else "full_attention" for is_local in local]
    ollama = _is_ollama_gemma3(metadata)
    # The file's scaling is the global layers' only; transformers' per-type defaults are not carried over.
    full = _rope_parameters({**config, "rope_parameters": {}}, "gemma3", metadata, tensor_names, read_f32_tensor,
                            file_name) or {}
    if ollama and not full and int(config.get("max_position_embeddings") or 0) >= GEMMA3_SCALED_CONTEXT:
        full = {"rope_type": "linear", "factor": GEMMA3_OLLAMA_LINEAR_FACTOR}
    theta = _first_number(metadata, ("gemma3.rope.freq_base", "gemma3.rope.global.freq_base"),
                          GEMMA3_GLOBAL_ROPE_THETA)
    local_theta = _first_number(metadata, ("gemma3.rope.freq_base_swa", "gemma3.rope.local.freq_base"),
                                GEMMA3_LOCAL_ROPE_THETA)
    return {"full_attention": {"rope_type": "default", **full, "rope_theta": theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}


def _is_ollama_gemma3(metadata: Mapping[str, object]) -> bool:
    """Whether a Gemma 3 GGUF shows one of Ollama's converter's marks in its metadata (llama.cpp's own test for
    them also looks for the bundled vision tensors, which come with Ollama's vision keys)."""
    return (any(key in metadata for key in OLLAMA_GEMMA3_KEYS)
            or "gemma3.attention.layer_norm_rms_epsilon" not in metadata)


def _first_number(metadata: Mapping[str, object], keys: tuple[str, ...], default: float) -> float:
    return next((float(value) for key in keys if isinstance(value := metadata.get(key), (int, float))), default)


def _rope_parameters(config: dict, architecture: str, metadata: Mapping[str, object], tensor_names: set[str],
                     read_f32_tensor: Callable[[str], np.ndarray], file_name: str) -> dict | None:
    """The config's rope_parameters when the GGUF scales its RoPE, None when it does not."""
    base = dict(config.get("rope_parameters") or {})
    scaling = metadata.get(f"{architecture}.rope.scaling.type")
    if longrope := sorted(tensor_names.intersection(LONGROPE_TENSORS)):
        raise CheckpointError(f"GGUF {file_name} scales its RoPE with LongRoPE factors ({', '.join(longrope)}), "
                              "which hearth does not read from GGUF files")
    if scaling == "linear":
        factor = metadata.get(f"{architecture}.rope.scaling.factor")
        if not isinstance(factor, (int, float)) or factor <= 0:
            raise CheckpointError(f"GGUF {file_name} states linear RoPE scaling without a valid factor ({factor!r})")
        return {**base, "rope_type": "linear", "factor": float(factor)}
    if scaling == "yarn":
        return {**base, **_yarn_parameters(config, architecture, metadata, file_name)}
    if scaling not in (None, "none"):
        raise CheckpointError(f"GGUF {file_name} scales its RoPE as {scaling!r}, which hearth does not read from "
                              "GGUF files (it reads linear, YaRN and Llama 3's rope_freqs)")
    if ROPE_FREQS_TENSOR not in tensor_names:
        return None
    if architecture != "llama":
        raise CheckpointError(f"GGUF {file_name} holds {ROPE_FREQS_TENSOR} for a {architecture} model; hearth reads "
                              "it as Llama 3's RoPE scaling only")
    theta = float(base.get("rope_theta") or metadata.get(f"{architecture}.rope.freq_base") or 10000.0)
    return llama3_rope_parameters(read_f32_tensor(ROPE_FREQS_TENSOR), theta, _head_size(config), file_name,
                                  base=base, original_context=metadata.get(
                                      f"{architecture}.rope.scaling.original_context_length"))


def _yarn_parameters(config: dict, architecture: str, metadata: Mapping[str, object], file_name: str) -> dict:
    """transformers' `yarn` parameters for a GGUF's YaRN scaling, as llama.cpp applies it: frequencies scaled by
    1 / factor, blended into the unscaled ones between the dimensions its beta_fast / beta_slow rotations bound over
    the original context, and cos/sin scaled by 1 + 0.1 ln(factor), which are transformers' defaults too. An
    extrapolation or attention factor other than 1 and a log multiplier (DeepSeek's) are refused: llama.cpp combines
    them with the above in ways transformers' parameters do not state."""
    def stated(key: str):
        return metadata.get(f"{architecture}.rope.scaling.{key}")

    factor = stated("factor")
    if not isinstance(factor, (int, float)) or factor < 1:
        raise CheckpointError(f"GGUF {file_name} states YaRN scaling without a factor of at least 1 ({factor!r})")
    for key, neutral in YARN_NEUTRAL_VALUES.items():
        if (value := stated(key)) is not None and not any(math.isclose(value, n) for n in neutral):
            raise CheckpointError(f"GGUF {file_name} states YaRN with rope.scaling.{key} of {value!r}, "
                                  "which hearth does not read from GGUF files")
    original = stated("original_context_length") or config.get("max_position_embeddings")
    rope = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
    for key in ("beta_fast", "beta_slow"):
        if isinstance(value := stated(f"yarn_{key}"), (int, float)):
            rope[key] = float(value)
    return rope


def llama_cpp_rope_divisors(theta: float, rotary_dims: int, factor: float, low_freq_factor: float,
                            high_freq_factor: float, original_context: float) -> np.ndarray:
    """The rope_freqs divisors llama.cpp's converter writes for a Llama 3 RoPE scaling (its own formula)."""
    frequencies = 1.0 / (theta ** (np.arange(0, rotary_dims, 2, dtype=np.float64) / rotary_dims))
    low_wavelength = original_context / low_freq_factor
    high_wavelength = original_context / high_freq_factor
    divisors = []
    for frequency in frequencies:
        wavelength = 2 * math.pi / frequency
        if wavelength < high_wavelength:
            divisors.append(1.0)
        elif wavelength > low_wavelength:
            divisors.append(factor)
        else:
            smooth = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float64)


def llama3_rope_parameters(divisors: np.ndarray, theta: float, rotary_dims: int, file_name: str, *,
                           base: Mapping[str, object] = (), original_context: object = None) -> dict | None:
    """transformers' `llama3` rope_parameters that give `divisors` (a GGUF's rope_freqs), None when every divisor
    is 1 (no scaling); CheckpointError when no such parameters give them back."""
    divisors = np.asarray(divisors, dtype=np.float64).reshape(-1)
    if divisors.size != rotary_dims // 2 or not np.all(np.isfinite(divisors)) or np.any(divisors <= 0):
        raise CheckpointError(f"GGUF {file_name}'s {ROPE_FREQS_TENSOR} holds {divisors.size} values, not one positive "
                              f"divisor for each of its {rotary_dims // 2} rotary frequencies")
    factor = float(f"{divisors.max():.6g}")
    if np.allclose(divisors, 1.0, rtol=ROPE_DIVISOR_RTOL):
        return None
    low, high = LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR
    wavelengths = 2 * math.pi * theta ** (np.arange(0, rotary_dims, 2, dtype=np.float64) / rotary_dims)
    between = (divisors > 1 + ROPE_DIVISOR_RTOL) & (divisors < factor * (1 - ROPE_DIVISOR_RTOL))
    if between.any():
        # A divisor between the bounds is 1 / ((1 - s) / factor + s), s = (context / wavelength - low) / (high - low).
        smooth = (1 / divisors[between] - 1 / factor) / (1 - 1 / factor)
        context = float(round(np.median(wavelengths[between] * (smooth * (high - low) + low))))
    elif isinstance(original_context, (int, float)) and original_context > 0:
        context = float(original_context)
    else:
        context = float(LLAMA3_DEFAULT_ORIGINAL_CONTEXT)
    expected = llama_cpp_rope_divisors(theta, rotary_dims, factor, low, high, context)
    if not np.allclose(expected, divisors, rtol=ROPE_DIVISOR_RTOL):
        raise CheckpointError(f"GGUF {file_name}'s {ROPE_FREQS_TENSOR} is no Llama 3 RoPE scaling with low and high "
                              f"frequency factors {low:g} and {high:g}, which is all hearth reads it as")
    return {**dict(base), "rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": int(context)}


def completed_config_of_file(config: dict, path: Path) -> dict:
    """completed_gguf_config for the GGUF at `path`, reading its header and (when it has one) its rope_freqs."""
    header = read_gguf_header(path)
    tensors = {tensor.name: tensor for tensor in header.split.tensors}

    def read_f32_tensor(name: str) -> np.ndarray:
        tensor = tensors[name]
        if tensor.block_type != "F32":
            raise CheckpointError(f"GGUF {path.name} stores {name} as {tensor.block_type}, not F32")
        with path.open("rb") as handle:
            handle.seek(tensor.data_start)
            return np.frombuffer(handle.read(tensor.n_bytes), dtype="<f4")

    config = completed_gguf_config(config, header.architecture or "", header.metadata, set(tensors),
                                   read_f32_tensor, path.name)
    if (embedding := tensors.get(EMBEDDING_TENSOR)) is not None:
        # The embedding's rows are the vocabulary the model computes over; transformers counts the tokenizer's
        # tokens, which Ollama's Gemma 3 files list beyond them.
        config["vocab_size"] = int(embedding.shape[0])
    return config
