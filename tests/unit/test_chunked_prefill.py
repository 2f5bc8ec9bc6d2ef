"""Chunked prefill: a prompt prefilled in successive chunks grows the session's KV cache exactly as one prefill
of the whole prompt does, so the greedy tokens that follow are the same (the orchestrator's chunked prefill,
hearth/services/orchestrator/prefill.py, relies on it)."""

from __future__ import annotations

import pytest
import torch

from hearth.inference import SamplingParams, load_full, load_head, load_layer_range
from tests.runner_limits import RUNNER_KV_LIMITS
from hearth.services.orchestrator.local_chain import LocalChain
from hearth.services.orchestrator.prefill import chunk_spans, prefill, step_spans
from hearth.services.transport import FrameKind

from .inference_tiny_models import one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures are used by name)

PROMPT = "hearth runs one model across the machines of a community mesh; the quick brown fox jumps over it"
DECODE_STEPS = 12
# Chunk sizes that divide the prompt unevenly, leave a one-token chunk, or exceed it (one chunk).
CHUNK_SIZES = [1, 5, 16, 1000]


def prefill_then_decode(head, hops, prompt_ids, chunk_tokens: int, session_id: str):
    """Prefill in chunks of `chunk_tokens`, then greedy decode; (last prefill logits, greedy tokens)."""
    hidden_out = None
    for start in range(0, len(prompt_ids), chunk_tokens):
        hidden_out = head.embed(prompt_ids[start:start + chunk_tokens])
        for runner in hops:
            hidden_out = runner.forward(session_id, hidden_out, start, "prefill")
    first_logits = head.logits(hidden_out)
    tokens = [head.sample(first_logits, SamplingParams(temperature=0.0))]
    position = len(prompt_ids)
    for _ in range(DECODE_STEPS):
        hidden = head.embed([tokens[-1]])
        for runner in hops:
            hidden = runner.forward(session_id, hidden, position, "decode")
        tokens.append(head.sample(head.logits(hidden), SamplingParams(temperature=0.0)))
        position += 1
    return first_logits, tokens


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_chunked_prefill_gives_the_greedy_tokens_of_one_prefill(tiny_model_dir, architecture):
    path = tiny_model_dir(architecture)
    head = load_head(path)
    prompt_ids = head.encode_prompt(PROMPT)
    hops = [load_layer_range(path, 0, 2, **RUNNER_KV_LIMITS), load_layer_range(path, 3, 5, **RUNNER_KV_LIMITS)]
    whole_logits, whole_tokens = prefill_then_decode(head, hops, prompt_ids, len(prompt_ids), "whole")
    for chunk_tokens in CHUNK_SIZES:
        logits, tokens = prefill_then_decode(head, hops, prompt_ids, chunk_tokens, f"chunks-of-{chunk_tokens}")
        assert tokens == whole_tokens, f"chunks of {chunk_tokens}"
        # Attention over a grown cache sums in another order than over one block: equal to float rounding.
        assert torch.allclose(logits, whole_logits, rtol=0, atol=1e-4), (
            f"chunks of {chunk_tokens}: logits differ by {(logits - whole_logits).abs().max().item():.2e}")
        assert all(runner.cached_tokens(f"chunks-of-{chunk_tokens}") == len(prompt_ids) + DECODE_STEPS
                   for runner in hops)


def test_chunk_spans_cover_the_prompt_once_in_order():
    assert chunk_spans(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_spans(10, 0) == [(0, 10)] == chunk_spans(10, 256)
    with pytest.raises(ValueError):
        chunk_spans(0, 4)


def test_a_reprefill_sends_the_prompt_in_its_chunks_and_the_decoded_tokens_as_replay_steps():
    prefill_, replay = FrameKind.prefill, FrameKind.replay
    # A first prefill: no decoded tokens, nothing replayed.
    assert step_spans(10, 4, replay_from=10) == [(0, 4, prefill_), (4, 8, prefill_), (8, 10, prefill_)]
    assert step_spans(10, 4) == step_spans(10, 4, replay_from=10)
    # Prompt of 10, 7 tokens decoded: the prompt's chunks as before, then the decoded tokens chunked on their own.
    assert step_spans(17, 4, replay_from=10) == [(0, 4, prefill_), (4, 8, prefill_), (8, 10, prefill_),
                                                 (10, 14, replay), (14, 17, replay)]
    assert step_spans(17, 0, replay_from=10) == [(0, 10, prefill_), (10, 17, replay)]
    # Hops holding the first 6 positions already (a kept prefix): spans count from there.
    assert step_spans(11, 0, start=6, replay_from=10) == [(0, 4, prefill_), (4, 11, replay)]
    # A kept prefix reaching past the prompt: everything sent is replayed.
    assert step_spans(3, 4, start=12, replay_from=10) == [(0, 3, replay)]


class KindsSeen(LocalChain):
    """A local chain that remembers the kind and the prompt length of every step it was sent."""

    def __init__(self, local, replay_steps: bool) -> None:
        super().__init__(local)
        self.replay_steps = replay_steps
        self.kinds: list[FrameKind] = []
        self.prompt_tokens: list[int | None] = []

    async def step(self, kind: FrameKind, pos: int, hidden: torch.Tensor,
                   prompt_tokens: int | None = None) -> torch.Tensor:
        self.kinds.append(kind)
        self.prompt_tokens.append(prompt_tokens)
        return await super().step(kind, pos, hidden, prompt_tokens)


@pytest.mark.parametrize("replay_steps", [True, False])
async def test_a_chain_whose_hops_take_no_replay_steps_gets_the_decoded_tokens_as_prefill_chunks(tiny_model_dir,
                                                                                                 replay_steps):
    local = load_full(tiny_model_dir("llama"), **RUNNER_KV_LIMITS)
    chain = KindsSeen(local, replay_steps)
    try:
        known = local.head.encode_prompt(PROMPT) + [5, 6, 7, 8, 9]
        await prefill(chain, local.head.embed(known), 4, replay_from=len(known) - 5)
        replayed = [FrameKind.replay] * 2 if replay_steps else [FrameKind.prefill] * 2
        assert chain.kinds[-2:] == replayed and set(chain.kinds[:-2]) == {FrameKind.prefill}
        # Every prefill chunk says how long its prompt is (the decoded tokens are one when sent as prefill).
        prompt = len(known) - 5 if replay_steps else len(known)
        assert chain.prompt_tokens == [prompt] * (len(chain.kinds) - 2) + ([None] * 2 if replay_steps else [prompt] * 2)
        assert local.runner.cached_tokens(chain.session_id) == len(known)
    finally:
        await chain.close()


async def test_the_local_fallback_prefills_in_chunks_to_the_same_greedy_token(tiny_model_dir):
    local = load_full(tiny_model_dir("llama"), **RUNNER_KV_LIMITS)
    prompt_ids = local.head.encode_prompt(PROMPT)
    hidden = local.head.embed(prompt_ids)
    whole, chunked = LocalChain(local), LocalChain(local)
    try:
        expected = await prefill(whole, hidden, 0)
        output = await prefill(chunked, hidden, 7)
        last_start, last_end = chunk_spans(len(prompt_ids), 7)[-1]
        assert output.shape[1] == last_end - last_start  # the last chunk's output, all the sampler needs
        greedy = SamplingParams(temperature=0.0)
        assert local.head.sample(local.head.logits(output), greedy) == local.head.sample(
            local.head.logits(expected), greedy)
        assert local.runner.cached_tokens(chunked.session_id) == len(prompt_ids)
    finally:
        await whole.close()
        await chunked.close()
