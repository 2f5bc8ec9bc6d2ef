"""Writing tiny GGUF files for tests the way llama.cpp's convert_hf_to_gguf.py does, from a HF model's state dict."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

from .inference_tiny_models import _COMMON, CHAT_TEMPLATE, TINY_CONFIGS, TINY_SLIDING_WINDOW, write_tiny_tokenizer

GGUF_ARCHITECTURE = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
                     "phi3": gguf.MODEL_ARCH.PHI3, "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3}
GEMMA3_GLOBAL_ROPE = {"rope_type": "linear", "factor": 8.0, "rope_theta": 100000.0}
# Plain tiny configs: a GGUF cannot state the sliding windows the shared tiny qwen2 config uses. Qwen3's heads are
# wider than hidden size / heads, as in Qwen3 itself (its GGUF states them as key and value lengths). Gemma 3 as its
# GGUF states it: five local layers to one global, local layers on base 10 000 and the global ones scaled linearly
# (Gemma 3 4B and up), on another base.
GGUF_TINY_CONFIGS = {"llama": lambda: LlamaConfig(**_COMMON), "qwen2": lambda: Qwen2Config(**_COMMON),
                     "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=True),
                     "phi3": TINY_CONFIGS["phi3"], "gemma2": TINY_CONFIGS["gemma2"],
                     "gemma3": lambda: Gemma3TextConfig(
                         **_COMMON, head_dim=16, sliding_window=TINY_SLIDING_WINDOW, query_pre_attn_scalar=16,
                         rope_parameters={"full_attention": dict(GEMMA3_GLOBAL_ROPE),
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})}
# A Llama 3 RoPE scaling whose divisors are neither all 1 nor all the factor for the tiny models' heads (see
# llama3_rope_freqs): head_dim 32, so three frequencies lie between the bounds.
LLAMA3_ROPE_OVERRIDES = dict(head_dim=32, max_position_embeddings=4096, rope_parameters={
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 2000})


# YaRN (Qwen3's and Qwen2.5's long-context setting) in small: four times the original context, over which the blend
# between scaled and unscaled frequencies spans several of the tiny heads' frequencies.
YARN_OVERRIDES = dict(max_position_embeddings=1024, rope_parameters={
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256})
YARN_BETAS_OVERRIDES = dict(max_position_embeddings=1024, rope_parameters={
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
    "beta_fast": 16.0, "beta_slow": 2.0})


# Phi-3.5's RoPE in small: LongRoPE factors over half of each head's dimensions (Phi-4-mini rotates three quarters),
# and an original context the test's prompts pass, so both factor sets are used.
PHI3_LONGROPE_OVERRIDES = dict(max_position_embeddings=256, original_max_position_embeddings=16, rope_parameters={
    "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
    "long_factor": [1.0, 1.7, 3.1, 6.5], "short_factor": [1.0, 1.1, 1.3, 1.9]})


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's convert_hf_to_gguf.py writes for a Llama 3 RoPE scaling (its loop)."""
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    low_wavelen = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    high_wavelen = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = ((rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"])
                      / (rope["high_freq_factor"] - rope["low_freq_factor"]))
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: Q/K rows from HF's rotary layout into GGML's."""
    if n_head_kv != n_head:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def stored_as(values: np.ndarray, block_type: GGMLQuantizationType) -> np.ndarray:
    """The array GGUFWriter stores for `values` in `block_type` (floats or quantized blocks)."""
    if block_type == GGMLQuantizationType.F32:
        return values.astype(np.float32)
    if block_type == GGMLQuantizationType.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, block_type)


def round_trip(values: np.ndarray, block_type: GGMLQuantizationType) -> np.ndarray:
    """What a reader gets back from `values` stored in `block_type`, as float32."""
    return gguf.quants.dequantize(stored_as(values, block_type), block_type).astype(np.float32)


def quantized_q6_k(values: np.ndarray) -> np.ndarray:
    """`values` (rows a multiple of 256 wide) as Q6_K blocks, which gguf.quants cannot write: per super-block of 256,
    16 sub-blocks of 16 values, each an int8 scale of the block's float16 d, the values 6-bit codes minus 32 packed
    as gguf.quants' Q6_K reader unpacks them (low nibbles, then the high two bits four to a byte)."""
    rows, columns = values.shape
    sub_blocks = values.astype(np.float32).reshape(-1, 16, 16)
    blocks = len(sub_blocks)
    extreme = np.take_along_axis(sub_blocks, np.abs(sub_blocks).argmax(axis=2)[..., None], axis=2)[..., 0]
    sub_scales = extreme / -32.0  # each sub-block's largest magnitude is code -32
    d = (np.take_along_axis(sub_scales, np.abs(sub_scales).argmax(axis=1)[:, None], axis=1)[:, 0] / -128.0)
    d = d.astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        scales = np.clip(np.nan_to_num(np.round(sub_scales / d.astype(np.float32)[:, None])), -128, 127).astype(np.int8)
        steps = d.astype(np.float32)[:, None, None] * scales.astype(np.float32)[..., None]
        codes = np.nan_to_num(np.round(sub_blocks / steps))
    codes = (np.clip(codes, -32, 31) + 32).astype(np.uint8)
    nibbles = (codes & 0x0F).reshape(blocks, 2, 2, 64)
    low = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(blocks, 128)
    tops = (codes >> 4).reshape(blocks, 2, 4, 32)
    high = (tops[:, :, 0] | (tops[:, :, 1] << 2) | (tops[:, :, 2] << 4) | (tops[:, :, 3] << 6)).reshape(blocks, 64)
    packed = np.concatenate([low, high, scales.view(np.uint8), d.reshape(blocks, 1).view(np.uint8)], axis=1)
    return packed.reshape(rows, -1)


IQ4_NL_LEVELS = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32)


def quantized_iq4_nl(values: np.ndarray) -> np.ndarray:
    """`values` (rows a multiple of 32 wide) as IQ4_NL blocks, which gguf.quants cannot write: per block of 32, a
    float16 d and each value's nearest of the 16 levels (int8, uneven) times d, as 4-bit indices (the block's first
    16 in the low nibbles)."""
    rows, _ = values.shape
    blocks = values.astype(np.float32).reshape(-1, 32)
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)[:, 0]
    d = (extreme / IQ4_NL_LEVELS[0]).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.nan_to_num(blocks / d.astype(np.float32)[:, None])
    indices = np.abs(scaled[..., None] - IQ4_NL_LEVELS).argmin(axis=2).astype(np.uint8)
    packed = np.concatenate([d.reshape(-1, 1).view(np.uint8), indices[:, :16] | (indices[:, 16:] << 4)], axis=1)
    return packed.reshape(rows, -1)


def q4_k_m_like(source: Path, path: Path, more_bits_layers: tuple[int, ...]) -> Path:
    """A copy of the float32 tiny llama GGUF `source` mixed as llama.cpp's Q4_K_M mixes a model: its layer matrices
    in 4-bit blocks (Q4_1), but attn_v (Q8_0: its rows are too narrow for a K-quant, as llama.cpp falls back) and
    ffn_down (Q6_K; the source's intermediate size a multiple of 256) of `more_bits_layers` in more bits."""

    def mixed(name: str, values: np.ndarray) -> tuple[np.ndarray, GGMLQuantizationType | None]:
        parts = name.split(".")
        if values.ndim != 2 or parts[0] != "blk":
            return values, None
        if int(parts[1]) in more_bits_layers and parts[2] == "attn_v":
            return gguf.quants.quantize(values, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
        if int(parts[1]) in more_bits_layers and parts[2] == "ffn_down":
            return quantized_q6_k(values), GGMLQuantizationType.Q6_K
        return gguf.quants.quantize(values, GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1

    return rewrite_gguf(source, path, "llama", mixed)


def _add_tokenizer(writer: gguf.GGUFWriter, folder: Path) -> None:
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    specials = {token["content"] for token in tokenizer["added_tokens"]}
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    merges = tokenizer["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)


def rewrite_gguf(source: Path, path: Path, architecture: str,
                 replace: Callable[[str, np.ndarray], tuple[np.ndarray, GGMLQuantizationType | None]]) -> Path:
    """A copy of the GGUF `source` at `path` with its architecture's keys and its tokenizer, each tensor written as
    `replace(name, values)` gives it back (values, and the GGML type of raw blocks or None)."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(path), architecture)
    for key, field in reader.fields.items():
        if key.startswith((f"{architecture}.", "tokenizer.")):
            writer.add_key_value(key, field.contents(), field.types[0])
    for tensor in reader.tensors:
        values, raw_type = replace(tensor.name, np.array(tensor.data))
        if raw_type is None:
            writer.add_tensor(tensor.name, values)
        else:
            writer.add_tensor(tensor.name, values, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


DROP = object()


def rewritten(source: Path, path: Path, *, keys: dict | None = None,
              tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of the llama GGUF `source` at `path`: metadata `keys` set (DROP: left out; a new key as (value,
    GGUFValueType)), `tensors` given new values."""
    keys, tensors = keys or {}, tensors or {}
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, field in reader.fields.items():
        if (key.startswith("llama.") or key == "tokenizer.ggml.eos_token_id") and keys.get(key) is not DROP:
            value = keys.pop(key, field.contents())
            writer.add_key_value(key, *(value if isinstance(value, tuple) else (value, field.types[0])))
    for key, (value, value_type) in ((k, v) for k, v in keys.items() if v is not DROP):
        writer.add_key_value(key, value, value_type)
    for tensor in reader.tensors:
        if tensor.name in tensors:
            writer.add_tensor(tensor.name, tensors[tensor.name])
        else:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_gguf(folder: Path, architecture: str, block_type: GGMLQuantizationType, *, seed: int = 0,
                    with_tokenizer: bool = True, gguf_architecture: str | None = None,
                    **config_overrides) -> tuple[Path, Path]:
    """A tiny random `architecture` model written as `folder`/tiny.gguf with its 2-D weights in `block_type`, and
    `folder`/reference: the same model as a safetensors checkpoint holding exactly the weights a reader of the GGUF
    gets back. Returns (gguf file, reference folder)."""
    torch.manual_seed(seed)
    config = GGUF_TINY_CONFIGS[architecture]()
    for key, value in config_overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reference = folder / "reference"
    write_tiny_tokenizer(reference)
    path = folder / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), gguf_architecture or gguf.MODEL_ARCH_NAMES[GGUF_ARCHITECTURE[architecture]])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = config.rope_parameters or {}
    # Gemma 3's file states its global layers' RoPE (Gemma3Model.set_gguf_parameters).
    rope = rope.get("full_attention", rope)
    rotary_dims = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(rotary_dims)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if architecture == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    if architecture == "gemma3":
        writer.add_sliding_window(config.sliding_window)
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    writer.add_file_type(int(block_type))
    if with_tokenizer:
        _add_tokenizer(writer, reference)
    else:
        writer.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(GGUF_ARCHITECTURE[architecture], config.num_hidden_layers)
    state = {}
    if rope.get("rope_type") == "yarn":  # TextModel.set_gguf_parameters
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key in ("beta_fast", "beta_slow"):
            if key in rope:
                writer.add_float32(f"{writer.arch}.rope.scaling.yarn_{key}", rope[key])
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, head_dim), raw_dtype=GGMLQuantizationType.F32)
    if rope.get("rope_type") == "longrope":  # Phi3MiniModel's set_gguf_parameters and generate_extra_tensors
        original = config.original_max_position_embeddings
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        writer.add_rope_scaling_orig_ctx_len(original)
        for name, factors in (("rope_factors_long.weight", rope["long_factor"]),
                              ("rope_factors_short.weight", rope["short_factor"])):
            writer.add_tensor(name, np.array(factors, dtype=np.float32), raw_dtype=GGMLQuantizationType.F32)
    for hf_name, tensor in model.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        values = tensor.numpy()
        stored_type = block_type if values.ndim == 2 else GGMLQuantizationType.F32
        state[hf_name] = torch.from_numpy(round_trip(values, stored_type))
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the converter writes no output tensor for tied embeddings
        if architecture in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            values = values + 1  # the converter stores Gemma's norms as 1 + weight; the reader takes 1 off again
            state[hf_name] = torch.from_numpy(values.astype(np.float32) - np.float32(1))
        if architecture == "llama" and base.endswith(("q_proj", "k_proj")):
            kv_heads = config.num_attention_heads if base.endswith("q_proj") else config.num_key_value_heads
            values = llama_cpp_permute(values, config.num_attention_heads, kv_heads)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", stored_as(values, stored_type), raw_dtype=stored_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.load_state_dict(state)
    model.save_pretrained(reference)
    return path, reference


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Parsed GGUF metadata (hearth/inference/gguf_cache.py) and digests go to the test's folder, not the user's
    cache."""
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """``make(architecture, block_type, **kwargs)``: (gguf file, reference safetensors folder), written once."""
    written: dict = {}

    def make(architecture: str, block_type: GGMLQuantizationType, **kwargs):
        key = (architecture, block_type, repr(sorted(kwargs.items())))
        if key not in written:
            folder = tmp_path_factory.mktemp(f"gguf-{architecture}-{block_type.name}")
            written[key] = write_tiny_gguf(folder, architecture, block_type, **kwargs)
        return written[key]

    return make


def hub_repository_of_a_tiny_gguf(tmp_path: Path, file: str) -> Path:
    """A repository folder (for the fake hub to serve) holding one tiny Q8_0 GGUF named `file` and a README; the
    GGUF's path there."""
    (tmp_path / "written").mkdir()
    path, _ = write_tiny_gguf(tmp_path / "written", "llama", GGMLQuantizationType.Q8_0)
    repository = tmp_path / "repository"
    repository.mkdir()
    shutil.copyfile(path, repository / file)
    (repository / "README.md").write_text("a tiny GGUF\n")
    return repository / file
