"""LongRoPE (Phi-3's long-context models) picks its short or long factors by the largest position of a call: a
session's rotary embedding must not depend on which other sessions share its batched step, nor on the pieces a shard
cuts its step into or the chunks the orchestrator sends a prompt in (Hearth-Prompt-Tokens), and replayed tokens
rotate as their decode steps did (hearth/inference/layer_call.py), over dynamic caches and static ones alike."""

from __future__ import annotations

import torch
from transformers import Phi3Config, Phi3ForCausalLM

import pytest

from hearth.inference import load_head, load_layer_range
from hearth.inference.batched import BatchRow
from tests.runner_limits import RUNNER_KV_LIMITS

from .gguf_files import PHI3_LONGROPE_OVERRIDES
from .inference_tiny_models import TINY_NUM_LAYERS, one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)
from .test_batched_decode import decode_eight_sessions_together
from .test_layer_slices import run_sliced

ORIGINAL_CONTEXT = PHI3_LONGROPE_OVERRIDES["original_max_position_embeddings"]
LONG_PROMPT = "the quick brown fox jumps over the lazy dog, twice"
STATIC_TOKENS = 64
# Dynamic caches, and static ones (hearth/inference/static_decode.py; eager on the CPU).
CACHES = [pytest.param({}, id="dynamic"), pytest.param({"static_cache_tokens": STATIC_TOKENS}, id="static")]


@pytest.mark.parametrize("cache_options", CACHES)
def test_sessions_either_side_of_the_original_context_decode_together_as_alone(tiny_model_dir, cache_options):
    batch, expected = decode_eight_sessions_together(tiny_model_dir("phi3", **PHI3_LONGROPE_OVERRIDES),
                                                     **cache_options)
    final = sorted(batch.positions.values())
    assert final[0] < ORIGINAL_CONTEXT < final[-1]  # some rows on the short factors throughout, some on the long
    assert batch.tokens == expected


@pytest.mark.parametrize("cache_options", CACHES)
def test_a_one_token_chunk_of_a_long_prompt_batched_with_a_decode_step_rotates_as_the_prompt(tiny_model_dir,
                                                                                             cache_options):
    """A prompt's one-token chunk below the original context, told the prompt's length past it, in a batched step
    beside another session's decode step: the long factors, as its solo step takes them."""
    path = tiny_model_dir("phi3", **PHI3_LONGROPE_OVERRIDES)
    solo, batched = (load_layer_range(path, 0, TINY_NUM_LAYERS - 1, **cache_options, **RUNNER_KV_LIMITS)
                     for _ in range(2))
    assert (batched._static is not None) == bool(cache_options)
    torch.manual_seed(0)
    hidden_size = load_head(path).info.hidden_size
    prompt, other_prompt = torch.randn(1, 10, hidden_size), torch.randn(1, 5, hidden_size)
    chunk, decoded = torch.randn(1, 1, hidden_size), torch.randn(1, 1, hidden_size)
    prompt_tokens = 2 * ORIGINAL_CONTEXT
    for runner in (solo, batched):
        runner.forward("prompt", prompt, 0, "prefill", prompt_tokens=prompt_tokens)
        runner.forward("other", other_prompt, 0, "prefill")
    expected = [solo.forward("prompt", chunk, 10, "prefill", prompt_tokens=prompt_tokens),
                solo.forward("other", decoded, 5, "decode")]

    got = batched.step_batch([BatchRow("prompt", chunk, 10, "prefill", prompt_tokens),
                              BatchRow("other", decoded, 5, "decode")])
    assert batched._static is None or batched._static.batched_steps_total == 1  # one batched step, not two solo
    for row, solo_row in zip(got, expected, strict=True):
        torch.testing.assert_close(row, solo_row, rtol=1e-3, atol=1e-3)  # batched products round otherwise


def test_a_step_past_the_original_context_rotates_as_one_whatever_its_pieces(tiny_model_dir):
    path = tiny_model_dir("phi3", **PHI3_LONGROPE_OVERRIDES)
    head = load_head(path)
    whole, pieced = (load_layer_range(path, 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS) for _ in range(2))
    prompt = head.embed(head.tokenizer.encode(LONG_PROMPT))
    assert prompt.shape[1] > 2 * ORIGINAL_CONTEXT

    expected = whole.forward("s", prompt, 0, "prefill")
    # Pieces of fewer tokens than the original context: the first ones alone would pick the short factors.
    got = run_sliced(pieced, "s", prompt, 0, "prefill", TINY_NUM_LAYERS, piece_tokens=ORIGINAL_CONTEXT // 2)
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)  # the pieces attend in other sums


def test_a_prompt_sent_in_chunks_rotates_as_the_whole_prompt_told_its_length(tiny_model_dir):
    path = tiny_model_dir("phi3", **PHI3_LONGROPE_OVERRIDES)
    head = load_head(path)
    whole, chunked, told = (load_layer_range(path, 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS) for _ in range(3))
    prompt = head.embed(head.tokenizer.encode(LONG_PROMPT))
    length, size = prompt.shape[1], ORIGINAL_CONTEXT // 2
    expected = whole.forward("s", prompt, 0, "prefill")

    def chunks(runner, prompt_tokens):
        return torch.cat([runner.forward("s", prompt[:, start:start + size], start, "prefill",
                                         prompt_tokens=prompt_tokens) for start in range(0, length, size)], dim=1)

    # The orchestrator's chunks (Hearth-Prompt-Tokens): as the shard's own pieces of the whole step, bit for bit.
    got = chunks(told, length)
    assert torch.equal(got, run_sliced(load_layer_range(path, 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS), "s",
                                       prompt, 0, "prefill", TINY_NUM_LAYERS, piece_tokens=size))
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    # Untold, the chunks before the original context's end rotate on the short factors.
    assert not torch.allclose(chunks(chunked, None), expected, rtol=1e-2, atol=1e-2)


def test_decoded_tokens_replayed_across_the_original_context_rotate_as_their_decode_steps(tmp_path):
    """A failover's replay of tokens decoded from below the original context to past it: each rotates on the factors
    its own decode step took, so the outputs are the decode steps' bit for bit (int8, heads of 64 dimensions: see
    test_replay_steps.py)."""
    hidden, prompt_tokens, replayed, original = 256, 40, 30, 50
    torch.manual_seed(0)
    Phi3ForCausalLM(Phi3Config(vocab_size=128, hidden_size=hidden, intermediate_size=512, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                               original_max_position_embeddings=original, pad_token_id=0,
                               rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                "long_factor": [1.0 + index / 4 for index in range(32)],
                                                "short_factor": [1.0 + index / 32 for index in range(32)]},
                               )).save_pretrained(tmp_path)
    runner = load_layer_range(tmp_path, 0, 1, quantization="int8", **RUNNER_KV_LIMITS)
    prompt, inputs = torch.randn(1, prompt_tokens, hidden), torch.randn(1, replayed, hidden)
    runner.forward("decoded", prompt, 0, "prefill")
    expected = [runner.forward("decoded", inputs[:, index:index + 1], prompt_tokens + index, "decode")
                for index in range(replayed)]

    runner.forward("replayed", prompt, 0, "prefill")
    assert prompt_tokens < original < prompt_tokens + replayed
    assert torch.equal(runner.forward("replayed", inputs, prompt_tokens, "replay"), torch.cat(expected, dim=1))
