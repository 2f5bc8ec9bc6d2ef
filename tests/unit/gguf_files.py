"""Writing tiny GGUF files for tests the way llama.cpp's convert_hf_to_gguf.py does, from a HF model's state dict."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from .inference_tiny_models import _COMMON, CHAT_TEMPLATE, write_tiny_tokenizer

GGUF_ARCHITECTURE = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}
# Plain tiny configs: a GGUF cannot state the sliding windows the shared tiny qwen2 config uses.
GGUF_TINY_CONFIGS = {"llama": lambda: LlamaConfig(**_COMMON), "qwen2": lambda: Qwen2Config(**_COMMON)}


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
    """A copy of the GGUF `source` at `path` with its architecture's keys and the eos id, each tensor written as
    `replace(name, values)` gives it back (values, and the GGML type of raw blocks or None)."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(path), architecture)
    for key, field in reader.fields.items():
        if key.startswith(f"{architecture}.") or key == "tokenizer.ggml.eos_token_id":
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
    head_dim = config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(int(block_type))
    if with_tokenizer:
        _add_tokenizer(writer, reference)
    else:
        writer.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(GGUF_ARCHITECTURE[architecture], config.num_hidden_layers)
    state = {}
    for hf_name, tensor in model.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        values = tensor.numpy()
        stored_type = block_type if values.ndim == 2 else GGMLQuantizationType.F32
        state[hf_name] = torch.from_numpy(round_trip(values, stored_type))
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
        key = (architecture, block_type, tuple(sorted(kwargs.items())))
        if key not in written:
            folder = tmp_path_factory.mktemp(f"gguf-{architecture}-{block_type.name}")
            written[key] = write_tiny_gguf(folder, architecture, block_type, **kwargs)
        return written[key]

    return make
