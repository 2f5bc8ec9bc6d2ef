"""Batched prefills (LayerRangeRunner.step_batch with rows of several tokens, hearth/inference/batched.py): prompts of
different lengths prefilled together give each session its solo greedy tokens, for every tiny architecture (past
the sliding window too); rows continuing a chunked prefill, starting one and decoding mix in one batch with the
results of the same steps run alone (bit for bit with int8 weights: a CPU's rows attend their own caches, while an
eager family stacks them); a padded row's output is finite and a row's error stays its own; a shard batches its hops'
short prefills (hearth/services/shard/compute.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from hearth.inference import SessionStateError, load_head, load_layer_range
from tests.runner_limits import RUNNER_KV_LIMITS
from hearth.inference.batched import BatchRow, StackingBuffers, _left_padded, _row_mask
from hearth.services.shard.compute import ShardCompute, runner_session
from hearth.services.transport import FrameKind

from .inference_tiny_models import ARCHITECTURES, TINY_NUM_LAYERS, one_torch_thread, tiny_model_dir  # noqa: F401
from .test_batched_decode import GREEDY, PROMPTS, BatchedSessions, solo_tokens
from .test_layer_slices import _open_hop, _received, shard_settings


class PrefilledTogether(BatchedSessions):
    """Sessions whose prompts are prefilled in one batched step per runner, then decoded together."""

    def join_all(self, prompts: dict[str, list[int]]) -> None:
        ids = list(prompts)
        hidden = {sid: self.head.embed(prompts[sid]) for sid in ids}
        for runner in self.runners:
            outputs = runner.step_batch([BatchRow(sid, hidden[sid], 0, "prefill") for sid in ids])
            assert all(isinstance(output, torch.Tensor) for output in outputs), outputs
            hidden = dict(zip(ids, outputs, strict=True))
        for sid in ids:
            assert hidden[sid].shape == (1, len(prompts[sid]), self.head.info.hidden_size)
            self.tokens[sid] = [self.head.sample(self.head.logits(hidden[sid]), GREEDY)]
            self.positions[sid] = len(prompts[sid])


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_prompts_of_different_lengths_prefilled_together_give_their_solo_tokens(tiny_model_dir, architecture):
    path = tiny_model_dir(architecture)
    head = load_head(path)
    runners = [load_layer_range(path, 0, 2, **RUNNER_KV_LIMITS), load_layer_range(path, 3, 5, **RUNNER_KV_LIMITS)]
    prompts = {f"s{i}": head.encode_prompt(text) for i, text in enumerate(PROMPTS)}
    assert len({len(ids) for ids in prompts.values()}) > 3  # really padded rows
    expected = {sid: solo_tokens(runners, head, ids) for sid, ids in prompts.items()}
    batch = PrefilledTogether(runners, head)
    batch.join_all(prompts)
    while len(batch.tokens["s0"]) < len(expected["s0"]):
        batch.step()
    assert batch.tokens == expected


@pytest.mark.parametrize("architecture", ["llama", "mistral"])  # full attention; a sliding window of 8
def test_continuing_starting_and_decoding_rows_in_one_batch_match_the_same_steps_alone(tiny_model_dir, architecture):
    path = tiny_model_dir(architecture)
    head = load_head(path)
    batched, alone = load_layer_range(path, 0, 5, **RUNNER_KV_LIMITS), load_layer_range(path, 0, 5, **RUNNER_KV_LIMITS)
    torch.manual_seed(0)
    first = {"chunked": torch.randn(1, 6, head.info.hidden_size), "decoding": torch.randn(1, 11, head.info.hidden_size)}
    for runner in (batched, alone):
        for sid, states in first.items():
            runner.forward(sid, states, 0, "prefill")
    rows = [BatchRow("chunked", torch.randn(1, 5, head.info.hidden_size), 6, "prefill"),
            BatchRow("fresh", torch.randn(1, 9, head.info.hidden_size), 0, "prefill"),
            BatchRow("decoding", torch.randn(1, 1, head.info.hidden_size), 11, "decode")]
    outputs = batched.step_batch(rows)
    for row, output in zip(rows, outputs, strict=True):
        reference = alone.forward(row.session_id, row.hidden_states, row.start_pos, row.kind)
        assert output.shape == reference.shape and torch.isfinite(output).all()
        torch.testing.assert_close(output, reference, rtol=1e-4, atol=1e-4)
        assert batched.cached_tokens(row.session_id) == alone.cached_tokens(row.session_id)


@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen3"])  # mistral: past its sliding window of 8
def test_with_int8_weights_every_row_of_a_batch_is_its_solo_step_bitwise(tiny_model_dir, architecture):
    """int8 products are exact per row, and on a CPU each row attends its own cache under its solo step's mask
    (hearth/inference/row_attention.py): continuing, starting and decoding rows equal the same steps alone, bit for
    bit."""
    path = tiny_model_dir(architecture)
    head = load_head(path)
    batched, alone = (load_layer_range(path, 0, 5, quantization="int8", **RUNNER_KV_LIMITS) for _ in range(2))
    torch.manual_seed(0)
    # Contexts far apart: stacked, the short row would be padded by dozens of keys.
    first = {"chunked": torch.randn(1, 6, head.info.hidden_size), "decoding": torch.randn(1, 45, head.info.hidden_size),
             "short": torch.randn(1, 2, head.info.hidden_size)}
    for runner in (batched, alone):
        for sid, states in first.items():
            runner.forward(sid, states, 0, "prefill")
    for step in range(3):
        rows = [BatchRow("decoding", torch.randn(1, 1, head.info.hidden_size), 45 + step, "decode"),
                BatchRow("short", torch.randn(1, 1, head.info.hidden_size), 2 + step, "decode")]
        if step == 0:
            rows += [BatchRow("chunked", torch.randn(1, 5, head.info.hidden_size), 6, "prefill"),
                     BatchRow("fresh", torch.randn(1, 9, head.info.hidden_size), 0, "prefill")]
        for row, output in zip(rows, batched.step_batch(rows), strict=True):
            assert torch.equal(output, alone.forward(row.session_id, row.hidden_states, row.start_pos, row.kind))


@pytest.mark.parametrize(("architecture", "stacks"), [("llama", False), ("mistral", False), ("gemma2", True)])
def test_on_a_cpu_sdpa_families_attend_row_by_row_and_eager_ones_stack(tiny_model_dir, monkeypatch, architecture,
                                                                         stacks):
    stacked = []
    original = StackingBuffers.left_padded
    monkeypatch.setattr(StackingBuffers, "left_padded",
                        lambda self, *args: stacked.append(1) or original(self, *args))
    path = tiny_model_dir(architecture)
    head = load_head(path)
    runner = load_layer_range(path, 0, 5, **RUNNER_KV_LIMITS)
    rows = [BatchRow("a", head.embed([1, 5, 6]), 0, "prefill"),
            BatchRow("b", head.embed([1, 7, 8, 9, 3]), 0, "prefill")]
    assert all(isinstance(output, torch.Tensor) for output in runner.step_batch(rows))
    rows = [BatchRow("a", head.embed([4]), 3, "decode"), BatchRow("b", head.embed([2]), 5, "decode")]
    assert all(isinstance(output, torch.Tensor) for output in runner.step_batch(rows))
    assert bool(stacked) is stacks


def test_a_prefill_row_s_own_error_does_not_stop_the_others(tiny_model_dir):
    path = tiny_model_dir("llama")
    head = load_head(path)
    runner = load_layer_range(path, 0, 5, **RUNNER_KV_LIMITS)
    outcomes = runner.step_batch([BatchRow("a", head.embed([1, 5, 6]), 0, "prefill"),
                                  BatchRow("late", head.embed([4, 2]), 3, "prefill"),  # continues nothing
                                  BatchRow("b", head.embed([1, 7, 8, 9, 3]), 0, "prefill"),
                                  BatchRow("c", head.embed([2]), 0, "warmup")])
    assert outcomes[0].shape == (1, 3, head.info.hidden_size) and outcomes[2].shape == (1, 5, head.info.hidden_size)
    assert isinstance(outcomes[1], SessionStateError)
    assert isinstance(outcomes[3], ValueError)
    assert runner.cached_tokens("a") == 3 and runner.cached_tokens("b") == 5 and runner.cached_tokens("late") == 0


@pytest.mark.parametrize("window", [None, 2])
def test_every_query_of_a_padded_batch_sees_a_key_and_no_row_sees_another_s_padding(window):
    # Rows: 3 new tokens on an empty cache, 1 on 4 stored, 5 on 2 stored; the batch is 5 tokens wide, keys 7 wide.
    stored, new_tokens = [0, 4, 2], [3, 1, 5]
    mask = _row_mask(stored, new_tokens, window, torch.zeros(3, 5, 8), SimpleNamespace(_attn_implementation="sdpa"))
    assert mask.shape == (3, 1, 5, 7)
    assert mask.any(dim=-1).all()  # padding queries too: an empty softmax row would be NaN
    for row, (n, t) in enumerate(zip(stored, new_tokens, strict=True)):
        for token in range(t):  # the row's real queries: its stored keys and its new ones up to itself
            query = 5 - t + token
            first_key, last_key = 7 - (n + t), 7 - t + token
            if window is not None:
                first_key = max(first_key, last_key - window + 1)
            assert mask[row, 0, query].nonzero().flatten().tolist() == list(range(first_key, last_key + 1))


async def test_a_shard_runs_the_short_prefills_of_its_hops_as_one_batch_and_long_ones_alone(tiny_model_dir):
    """Three hops' prompts reach a shard together: the two short ones (within a factor of two in tokens) run as one
    batched prefill, the one long enough to run in turns alone; each hop gets its own rows, equal to its solo step
    within rounding (the long one bitwise), and the batch is counted."""
    path = tiny_model_dir("llama")
    head = load_head(path)
    runner = load_layer_range(path, 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS)
    alone = load_layer_range(path, 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS)
    compute = ShardCompute(runner, "shard-0", shard_settings(batch_window_ms=30_000.0, max_batch_sessions=8,
                                                             max_batch_tokens=1 << 20, prefill_slice_layers=1,
                                                             prefill_slice_min_tokens=32))
    compute.start()
    # The two short prompts' hops: once both steps are queued the window ends (the long step never queues there).
    compute.active_streams = 2
    prompts = {"a": head.encode_prompt("the quick brown fox"), "b": head.encode_prompt("hearth runs one model here"),
               "long": head.tokenizer.encode(" ".join(["the quick brown fox"] * 10))}
    assert len(prompts["long"]) >= 32 and all(len(prompts[s]) < 32 for s in "ab")
    results = await asyncio.wait_for(asyncio.gather(*(
        compute.run(_open_hop(sid, TINY_NUM_LAYERS - 1), _received(sid, FrameKind.prefill, 0, head.embed(ids)))
        for sid, ids in prompts.items())), timeout=30)
    for (sid, ids), result in zip(prompts.items(), results, strict=True):
        expected = alone.forward(sid, head.embed(ids), 0, "prefill")
        assert result.failed_check is None and result.output.shape == expected.shape
        if sid == "long":
            assert torch.equal(result.output, expected)
        else:
            torch.testing.assert_close(result.output, expected, rtol=1e-4, atol=1e-4)
    assert compute.prefill_batching_figures() == (1, 2) and compute.batching_figures() == (0, 0)
    await compute.close()


async def test_a_replay_step_runs_alone_at_once_never_waiting_for_a_batch(tiny_model_dir):
    """A short replay (tokens a session decoded, sent again after a failover) would batch like a short prefill; its
    queries attend alone, so the shard runs it at once instead of waiting out the batch window for other hops."""
    path = tiny_model_dir("llama")
    head = load_head(path)
    runner = load_layer_range(path, 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS)
    alone = load_layer_range(path, 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS)
    compute = ShardCompute(runner, "shard-0", shard_settings(batch_window_ms=30_000.0, max_batch_sessions=8,
                                                             max_batch_tokens=1 << 20))
    compute.start()
    compute.active_streams = 2  # another hop is open: a batchable step would wait for its step
    prompt, decoded = head.embed(head.encode_prompt("the quick brown fox")), head.embed([5, 6, 7])
    runner.forward(runner_session(_open_hop("s", TINY_NUM_LAYERS - 1)), prompt, 0, "prefill")
    alone.forward("s", prompt, 0, "prefill")
    result = await asyncio.wait_for(compute.run(_open_hop("s", TINY_NUM_LAYERS - 1),
                                                _received("s", FrameKind.replay, prompt.shape[1], decoded)), timeout=10)
    assert torch.equal(result.output, alone.forward("s", decoded, prompt.shape[1], "replay"))
    assert compute.prefill_batching_figures() == (0, 0) and compute.batching_figures() == (0, 0)
    await compute.close()


def test_a_batch_of_one_row_is_the_solo_step_bitwise(tiny_model_dir):
    path = tiny_model_dir("qwen2")
    head = load_head(path)
    batched, alone = load_layer_range(path, 0, 5, **RUNNER_KV_LIMITS), load_layer_range(path, 0, 5, **RUNNER_KV_LIMITS)
    prompt = head.embed(head.encode_prompt("hearth runs one model"))
    (output,) = batched.step_batch([BatchRow("a", prompt, 0, "prefill")])
    assert torch.equal(output, alone.forward("a", prompt, 0, "prefill"))
    (output,) = batched.step_batch([BatchRow("a", head.embed([7]), prompt.shape[1], "decode")])
    assert torch.equal(output, alone.forward("a", head.embed([7]), prompt.shape[1], "decode"))


def test_stacking_buffers_pad_like_fresh_zeros_whatever_an_earlier_step_left_in_them():
    buffers = StackingBuffers()
    # An earlier, wider step leaves non-finite values where this step's padding goes: masked keys must still be
    # zeros, since a masked weight of 0 times a NaN value would poison the row.
    buffers.left_padded(StackingBuffers.KEYS, [torch.full((1, 2, 9, 4), float("nan"))] * 3, 9)
    storage = buffers.nbytes
    rows = [torch.randn(1, 2, tokens, 4) for tokens in (5, 2, 7)]
    stacked = buffers.left_padded(StackingBuffers.KEYS, rows, 7)
    assert torch.equal(stacked, _left_padded(rows, 7))
    assert stacked.is_contiguous() and stacked.shape == (3, 2, 7, 4)
    assert buffers.nbytes == storage  # the smaller step reused the storage


def test_stacking_buffers_keep_keys_and_values_apart_and_grow_with_headroom():
    buffers = StackingBuffers()
    keys = buffers.left_padded(StackingBuffers.KEYS, [torch.ones(1, 1, 3, 2)], 3)
    values = buffers.left_padded(StackingBuffers.VALUES, [torch.zeros(1, 1, 3, 2)], 3)
    assert torch.equal(keys, torch.ones(1, 1, 3, 2)) and torch.equal(values, torch.zeros(1, 1, 3, 2))
    before = buffers.nbytes
    buffers.left_padded(StackingBuffers.KEYS, [torch.ones(1, 1, 5, 2)], 5)
    grown = buffers.nbytes
    assert grown > before
    buffers.left_padded(StackingBuffers.KEYS, [torch.ones(1, 1, 7, 2)], 7)  # a few tokens more: within the headroom
    assert buffers.nbytes == grown
