"""Tiny random checkpoints of every supported architecture (plus a byte-level tokenizer) for tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

TINY_VOCAB_SIZE = 320
TINY_NUM_LAYERS = 6
TINY_HIDDEN_SIZE = 64
# Larger than transformers' 0.02 so random logits are far from uniform and greedy choices are clear-cut.
TINY_INIT_STD = 0.25
# Small enough that prompt + 20 decode steps cross it, so sliding-window masks and caches are exercised.
TINY_SLIDING_WINDOW = 8

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hearth runs one model across the machines of a community mesh",
    "grüße aus köln — naïve café, 東京 and emoji 🔥🙂 are multi-byte",
    "<|user|> hello there <|assistant|> hi! how can I help you today?",
] * 4

TINY_EOS_TOKEN_ID = 2

_COMMON = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=TINY_HIDDEN_SIZE,
    intermediate_size=128,
    num_hidden_layers=TINY_NUM_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=TINY_INIT_STD,
    bos_token_id=1,
    eos_token_id=TINY_EOS_TOKEN_ID,
    pad_token_id=0,
)

TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**_COMMON),
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=TINY_SLIDING_WINDOW),
    # Layers >= max_window_layers use sliding windows: a per-layer mix of mask kinds.
    "qwen2": lambda: Qwen2Config(
        **_COMMON, use_sliding_window=True, sliding_window=TINY_SLIDING_WINDOW, max_window_layers=3
    ),
    "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=16, tie_word_embeddings=True),
    "phi3": lambda: Phi3Config(**_COMMON, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
    "gemma3": lambda: Gemma3TextConfig(
        **_COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=TINY_SLIDING_WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    ),
    "gemma2": lambda: Gemma2Config(
        **_COMMON,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=TINY_SLIDING_WINDOW,
        final_logit_softcapping=3.0,
        attn_logit_softcapping=5.0,
    ),
}
ARCHITECTURES = sorted(TINY_CONFIGS)


def write_tiny_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (vocab <= TINY_VOCAB_SIZE) with BOS added and a chat template."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(path)
    return wrapped


def tiny_config(architecture: str, **overrides):
    config = TINY_CONFIGS[architecture]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def write_tiny_model(
    path: Path,
    architecture: str,
    *,
    max_shard_size: str | None = None,
    seed: int = 0,
    with_tokenizer: bool = True,
    **config_overrides,
) -> Path:
    """Save a randomly initialised fp32 model of ``architecture`` (and the tiny tokenizer) to ``path``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config(architecture, **config_overrides), dtype=torch.float32
    )
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **save_kwargs)
    if with_tokenizer:
        write_tiny_tokenizer(path)
    return path


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tests share two busy cores with other engineers; tiny models gain nothing from more threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """``make(architecture, **kwargs)``: a saved tiny checkpoint, written once per distinct argument set."""
    written: dict[tuple, Path] = {}

    def make(architecture: str, **kwargs) -> Path:
        key = (architecture, repr(sorted(kwargs.items())))
        if key not in written:
            folder = tmp_path_factory.mktemp(f"tiny-{architecture}")
            written[key] = write_tiny_model(folder, architecture, **kwargs)
        return written[key]

    return make
