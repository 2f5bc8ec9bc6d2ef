"""Batched head steps (hearth/inference/head_batch.py, hearth/services/orchestrator/head_batcher.py): sessions whose
final norm + lm_head run as one product pick the greedy tokens each picks alone, for every tiny architecture, also while
sessions join and leave; near ties are recomputed alone; seeded sampling does not depend on the batch; a malformed row
fails alone; and HeadSteps batches the steps of the calls decoding together while a lone call never waits."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hearth.inference import load_head
from hearth.inference.compute_thread import StepThreads
from hearth.inference.cpu_kernels import onednn_linear, onednn_linear_available
from hearth.inference.head import head_onednn_min_rows
from hearth.inference.head_batch import HeadRow, batched_next_tokens, solo_next_token
from hearth.inference.sampling import SamplingParams
from hearth.services.common.config import OrchestratorSettings
from hearth.services.common.metrics import metrics_observed, sample_value, set_metrics_observed
from hearth.services.orchestrator.head_batcher import HeadSteps

from .inference_tiny_models import ARCHITECTURES, one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)
from .test_batched_decode import GREEDY, BatchedSessions, decode_eight_sessions_together, join_and_leave

LONG_WINDOW_MS = 30_000.0


class BatchedHeadSessions(BatchedSessions):
    """Sessions decoded together whose head steps run as one batch too (as on the mesh: shards and orchestrator)."""

    def next_tokens(self, hidden_states) -> list[int]:
        tokens = batched_next_tokens(self.head, [HeadRow(states, GREEDY) for states in hidden_states])
        assert all(isinstance(token, int) for token in tokens)
        return tokens


def rows_of(head, count: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 1 + index % 3, head.info.hidden_size, generator=generator) for index in range(count)]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_eight_sessions_with_a_batched_head_give_their_solo_tokens(tiny_model_dir, architecture):
    batch, expected = decode_eight_sessions_together(tiny_model_dir(architecture), BatchedHeadSessions)
    assert batch.tokens == expected


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_batched_logits_stay_within_their_bound_of_the_solo_ones(tiny_model_dir, architecture):
    head = load_head(tiny_model_dir(architecture))
    states = rows_of(head, 8)
    logits, bounds = head.batch_logits(states)
    for row, hidden in enumerate(states):
        difference = (logits[row] - head.logits(hidden)).abs().max()
        assert difference <= bounds[row]


@pytest.mark.skipif(not onednn_linear_available(), reason="oneDNN's linear is not in this torch build")
@pytest.mark.parametrize("rows", [2, head_onednn_min_rows - 1, head_onednn_min_rows, 8])
def test_few_rows_take_the_tall_product_and_more_take_onednn_within_the_same_bound(tiny_model_dir, rows):
    head = load_head(tiny_model_dir("llama"))
    states = rows_of(head, rows)
    logits, bounds = head.batch_logits(states)
    normed = head._final_norm(torch.cat([hidden[:, -1, :] for hidden in states]))
    weight = head._lm_head.weight
    expected = onednn_linear(normed, weight, None) if rows >= head_onednn_min_rows else (weight @ normed.T).T
    assert torch.equal(logits, expected.float())
    for row, hidden in enumerate(states):
        assert (logits[row] - head.logits(hidden)).abs().max() <= bounds[row]


def test_sessions_joining_and_leaving_a_batched_head_leave_the_others_unchanged(tiny_model_dir):
    joins = {2: "s2", 4: "s3", 6: "s4"}
    finished, expected = join_and_leave(tiny_model_dir("gemma2"), BatchedHeadSessions, joins)  # soft-capped logits
    assert finished == expected


def test_an_exact_tie_is_recomputed_alone_and_picks_the_solo_token(tiny_model_dir):
    head = load_head(tiny_model_dir("llama"))
    states = rows_of(head, 6, seed=3)
    rows = [HeadRow(hidden, GREEDY) for hidden in states]
    bests = {int(torch.argmax(head.logits(hidden))) for hidden in states}
    spare = [token for token in range(head.info.vocab_size) if token not in bests]
    with torch.no_grad():  # make every row's two best tokens tie exactly: a copy of each best token's lm_head row
        for best, twin in zip(sorted(bests), spare, strict=False):
            head._lm_head.weight[twin] = head._lm_head.weight[best]
    logits, bounds = head.batch_logits(states)
    top_two = torch.topk(logits, 2, dim=1).values
    assert bool(((top_two[:, 0] - top_two[:, 1]) <= 2 * bounds).all())  # every row takes the recompute path
    assert batched_next_tokens(head, rows) == [solo_next_token(head, row) for row in rows]


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_model_dir):
    head = load_head(tiny_model_dir("qwen3"))
    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    states = rows_of(head, 5, seed=7)

    def draws(companions: list[torch.Tensor]) -> list[int]:
        generator = seeded.make_generator()
        tokens = []
        for step in range(6):
            rows = [HeadRow(states[step % len(states)], seeded, generator)]
            rows += [HeadRow(hidden, GREEDY) for hidden in companions]
            tokens.append(batched_next_tokens(head, rows)[0])
        return tokens

    alone = draws([])
    assert draws(states[:3]) == alone and draws(states[1:]) == alone
    unseeded = SamplingParams(temperature=0.9)
    tokens = batched_next_tokens(head, [HeadRow(hidden, unseeded, unseeded.make_generator()) for hidden in states])
    assert all(0 <= token < head.info.vocab_size for token in tokens)


def test_a_malformed_row_fails_alone(tiny_model_dir):
    head = load_head(tiny_model_dir("phi3"))
    good = rows_of(head, 3)
    rows = [HeadRow(good[0], GREEDY), HeadRow(torch.zeros(1, 1, 3), GREEDY), HeadRow(good[1], GREEDY),
            HeadRow(good[2], GREEDY)]
    outcomes = batched_next_tokens(head, rows)
    assert isinstance(outcomes[1], ValueError)
    assert [outcomes[i] for i in (0, 2, 3)] == [solo_next_token(head, rows[i]) for i in (0, 2, 3)]


def head_steps(sessions: int, window_ms: float = LONG_WINDOW_MS) -> HeadSteps:
    settings = OrchestratorSettings(head_batch_sessions=sessions, head_batch_window_ms=window_ms)
    return HeadSteps(settings, StepThreads(), running_calls=lambda: 1)


async def test_head_steps_of_the_calls_decoding_together_run_as_one_batch(tiny_model_dir):
    head = load_head(tiny_model_dir("mistral"))
    steps = head_steps(8)
    rows = [HeadRow(hidden, GREEDY) for hidden in rows_of(head, 3)]
    with steps.decoding(), steps.decoding(), steps.decoding():
        results = await asyncio.wait_for(asyncio.gather(*(steps.next_token(head, row) for row in rows)), timeout=30)
    assert [token for token, _ in results] == [solo_next_token(head, row) for row in rows]
    for token, embedding in results:
        assert torch.equal(embedding, head.embed([token]))
    assert steps.batching_figures == (1, 3)  # the window ended as soon as every decoding call had a step queued
    await steps.close()


async def test_a_call_decoding_alone_never_waits_and_one_session_means_off(tiny_model_dir):
    head = load_head(tiny_model_dir("llama"))
    row = HeadRow(rows_of(head, 1)[0], GREEDY)
    for steps in (head_steps(8), head_steps(1)):
        with steps.decoding():
            token, _ = await asyncio.wait_for(steps.next_token(head, row), timeout=30)
        assert token == solo_next_token(head, row)
        await steps.close()
    assert head_steps(1).batching_figures == (0, 0)


@pytest.fixture
def observing():
    """Per-step observations on for the test, as they were afterwards."""
    before = metrics_observed()
    set_metrics_observed(True)
    yield
    set_metrics_observed(before)


async def test_each_head_step_is_timed_once_a_batch_or_alone(tiny_model_dir, observing):
    head = load_head(tiny_model_dir("llama"))
    rows = [HeadRow(hidden, GREEDY) for hidden in rows_of(head, 3)]
    before = sample_value("hearth_head_step_seconds_count")
    batched = head_steps(8)
    with batched.decoding(), batched.decoding(), batched.decoding():
        await asyncio.wait_for(asyncio.gather(*(batched.next_token(head, row) for row in rows)), timeout=30)
    await batched.close()
    assert sample_value("hearth_head_step_seconds_count") == before + 1
    alone = head_steps(1)
    with alone.decoding():
        await asyncio.wait_for(alone.next_token(head, rows[0]), timeout=30)
    assert sample_value("hearth_head_step_seconds_count") == before + 2
