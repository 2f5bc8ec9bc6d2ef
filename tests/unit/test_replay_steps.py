"""Replay steps (LayerRangeRunner kind "replay", hearth/inference/layer_pass.py): tokens a session decoded one by one,
prefilled again in one step (whole, in pieces, or beside another session's rows in a batch), rebuild the cache their
decode steps built: with int8 or int4 layers on a CPU the replayed outputs and every later decode step equal the
uninterrupted session's bit for bit; a replay continues a session, never starts one.

The model has heads of 64 dimensions and the contexts run past 32 positions: there a prefill's attention blocks its
sums otherwise than one query's, which the tiny test models' 16-dimension heads never show."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hearth.inference import SessionStateError, load_layer_range
from hearth.inference.batched import BatchRow
from tests.runner_limits import RUNNER_KV_LIMITS

from .inference_tiny_models import one_torch_thread  # noqa: F401  (fixture)

HIDDEN, PROMPT_TOKENS, REPLAYED, AFTER = 256, 40, 30, 4


@pytest.fixture(scope="module")
def wide_heads_model(tmp_path_factory):
    """A 2-layer random Llama with 4 query heads of 64 dimensions; key/value heads: 4 or 2 (grouped queries)."""
    def build(key_value_heads: int):
        folder = tmp_path_factory.mktemp(f"wide-heads-{key_value_heads}")
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=key_value_heads,
                                     max_position_embeddings=256)).save_pretrained(folder)
        return folder
    return build


def decoded_one_by_one(runner, prompt: torch.Tensor, inputs: torch.Tensor) -> list[torch.Tensor]:
    runner.forward("decoded", prompt, 0, "prefill")
    return [runner.forward("decoded", inputs[:, index:index + 1], PROMPT_TOKENS + index, "decode")
            for index in range(inputs.shape[1])]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("key_value_heads", [4, 2])
@pytest.mark.parametrize("piece_tokens", [None, 7])
def test_replayed_tokens_rebuild_the_cache_their_decode_steps_built(wide_heads_model, quantization, key_value_heads,
                                                                     piece_tokens):
    runner = load_layer_range(wide_heads_model(key_value_heads), 0, 1, quantization=quantization, **RUNNER_KV_LIMITS)
    torch.manual_seed(1)
    prompt = torch.randn(1, PROMPT_TOKENS, HIDDEN)
    inputs = torch.randn(1, REPLAYED + AFTER, HIDDEN)
    expected = decoded_one_by_one(runner, prompt, inputs)

    runner.forward("replayed", prompt, 0, "prefill")
    step = runner.begin_forward("replayed", inputs[:, :REPLAYED], PROMPT_TOKENS, "replay")
    replayed = None
    while replayed is None:
        replayed = runner.advance(step, 1, piece_tokens)
    assert torch.equal(replayed, torch.cat(expected[:REPLAYED], dim=1))
    for index in range(REPLAYED, REPLAYED + AFTER):
        output = runner.forward("replayed", inputs[:, index:index + 1], PROMPT_TOKENS + index, "decode")
        assert torch.equal(output, expected[index])


def test_a_replay_in_a_batch_runs_alone_and_still_equals_its_decode_steps(wide_heads_model):
    runner = load_layer_range(wide_heads_model(4), 0, 1, quantization="int8", **RUNNER_KV_LIMITS)
    torch.manual_seed(2)
    prompt = torch.randn(1, PROMPT_TOKENS, HIDDEN)
    inputs = torch.randn(1, REPLAYED, HIDDEN)
    expected = decoded_one_by_one(runner, prompt, inputs)
    runner.forward("replayed", prompt, 0, "prefill")
    runner.forward("other", prompt, 0, "prefill")
    replayed, other = runner.step_batch([BatchRow("replayed", inputs, PROMPT_TOKENS, "replay"),
                                         BatchRow("other", inputs[:, :1], PROMPT_TOKENS, "decode")])
    assert torch.equal(replayed, torch.cat(expected, dim=1))
    assert torch.equal(other, expected[0])


def test_a_replay_continues_a_session_and_never_starts_one(wide_heads_model):
    runner = load_layer_range(wide_heads_model(4), 0, 1, **RUNNER_KV_LIMITS)
    with pytest.raises(SessionStateError):
        runner.forward("fresh", torch.randn(1, 3, HIDDEN), 0, "replay")
