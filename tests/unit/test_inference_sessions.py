"""Per-session KV caches of LayerRangeRunner: isolation, reset, byte accounting, LRU/TTL eviction, errors."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hearth.inference import (
    EvictedSession,
    RunnerClosedError,
    SessionStateError,
    SessionTooLargeError,
    load_head,
    load_layer_range,
)
from tests.runner_limits import KV_BUDGET_BYTES, RUNNER_KV_LIMITS, SESSION_TTL_S

from .inference_tiny_models import one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)

# Tiny llama: 2 KV heads x head_dim 16, keys and values, float32.
KV_BYTES_PER_TOKEN_PER_LAYER = 2 * 2 * 16 * 4


class FakeClock:
    def __init__(self):
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def llama(tiny_model_dir):
    path = tiny_model_dir("llama")
    return path, load_head(path)


def greedy_steps(runner, head, session_id, prompt_ids, steps, *, layers=None):
    """Prefill + decode ``steps`` tokens on one runner (whose output feeds the head directly)."""
    hidden = runner.forward(session_id, head.embed(prompt_ids), 0, "prefill", layers=layers)
    position, outputs = len(prompt_ids), [hidden]
    for _ in range(steps):
        token = int(torch.argmax(head.logits(hidden)))
        hidden = runner.forward(session_id, head.embed([token]), position, "decode", layers=layers)
        position += 1
        outputs.append(hidden)
    return outputs


def test_interleaved_sessions_do_not_disturb_each_other(llama):
    path, head = llama
    alone_a = greedy_steps(load_layer_range(path, 0, 5, **RUNNER_KV_LIMITS), head, "a", [1, 10, 11, 12], 6)
    alone_b = greedy_steps(load_layer_range(path, 0, 5, **RUNNER_KV_LIMITS), head, "b", [1, 40, 41], 6)

    runner = load_layer_range(path, 0, 5, **RUNNER_KV_LIMITS)
    states = {"a": ([1, 10, 11, 12], alone_a), "b": ([1, 40, 41], alone_b)}
    hidden = {sid: runner.forward(sid, head.embed(ids), 0, "prefill") for sid, (ids, _) in states.items()}
    position = {sid: len(ids) for sid, (ids, _) in states.items()}
    for step in range(1, 7):
        for sid in ("b", "a"):
            assert torch.equal(hidden[sid], states[sid][1][step - 1])
            token = int(torch.argmax(head.logits(hidden[sid])))
            hidden[sid] = runner.forward(sid, head.embed([token]), position[sid], "decode")
            position[sid] += 1
    assert torch.equal(hidden["a"], alone_a[-1]) and torch.equal(hidden["b"], alone_b[-1])
    assert sorted(runner.session_ids()) == ["a", "b"]


def test_concurrent_threads_get_the_same_results_as_sequential_calls(llama):
    path, head = llama
    prompts = {f"s{i}": [1, 20 + i, 30 + i] for i in range(4)}
    sequential = {
        sid: greedy_steps(load_layer_range(path, 0, 5, **RUNNER_KV_LIMITS), head, sid, ids, 4)
        for sid, ids in prompts.items()
    }
    shared = load_layer_range(path, 0, 5, **RUNNER_KV_LIMITS)
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {sid: pool.submit(greedy_steps, shared, head, sid, ids, 4) for sid, ids in prompts.items()}
        concurrent = {sid: future.result(timeout=60) for sid, future in futures.items()}
    for sid in prompts:
        assert all(torch.equal(x, y) for x, y in zip(sequential[sid], concurrent[sid], strict=True))


def test_session_bytes_count_exactly_the_cached_keys_and_values(llama):
    path, head = llama
    runner = load_layer_range(path, 2, 4, **RUNNER_KV_LIMITS)  # 3 layers
    runner.forward("s", head.embed([1, 2, 3, 4, 5]), 0, "prefill")
    assert runner.session_bytes("s") == 5 * 3 * KV_BYTES_PER_TOKEN_PER_LAYER
    runner.forward("s", head.embed([6]), 5, "decode")
    assert runner.session_bytes("s") == 6 * 3 * KV_BYTES_PER_TOKEN_PER_LAYER
    assert runner.cache_bytes == runner.session_bytes("s")
    assert runner.cached_tokens("s") == 6
    assert runner.session_bytes("unknown") == 0


def test_reset_frees_the_session_and_starts_it_over(llama):
    path, head = llama
    runner = load_layer_range(path, 0, 5, **RUNNER_KV_LIMITS)
    first = runner.forward("s", head.embed([1, 7, 8]), 0, "prefill")
    runner.forward("s", head.embed([9]), 3, "decode")
    held = runner.session_bytes("s")
    assert held > 0
    assert runner.reset("s") == held
    assert runner.cache_bytes == 0 and runner.session_ids() == []
    with pytest.raises(SessionStateError, match="re-prefill"):
        runner.forward("s", head.embed([9]), 3, "decode")
    assert torch.equal(runner.forward("s", head.embed([1, 7, 8]), 0, "prefill"), first)
    assert runner.reset("never-seen") == 0


def test_prefill_at_position_zero_replaces_an_existing_session(llama):
    path, head = llama
    runner = load_layer_range(path, 0, 5, **RUNNER_KV_LIMITS)
    first = runner.forward("s", head.embed([1, 7, 8]), 0, "prefill")
    runner.forward("s", head.embed([9]), 3, "decode")
    again = runner.forward("s", head.embed([1, 7, 8]), 0, "prefill")  # e.g. a re-prefill after failover
    assert torch.equal(again, first)
    assert runner.cached_tokens("s") == 3


def test_a_step_at_the_wrong_position_is_refused_and_leaves_the_session_intact(llama):
    path, head = llama
    runner = load_layer_range(path, 0, 5, **RUNNER_KV_LIMITS)
    reference = load_layer_range(path, 0, 5, **RUNNER_KV_LIMITS)
    for r in (runner, reference):
        r.forward("s", head.embed([1, 7, 8]), 0, "prefill")
    with pytest.raises(SessionStateError, match="3 cached tokens but the step starts at position 5"):
        runner.forward("s", head.embed([9]), 5, "decode")
    with pytest.raises(SessionStateError, match="no cache"):
        runner.forward("other", head.embed([9]), 3, "decode")
    assert torch.equal(
        runner.forward("s", head.embed([9]), 3, "decode"),
        reference.forward("s", head.embed([9]), 3, "decode"),
    )


def test_sub_range_steps_must_continue_the_layers_they_started_on(llama):
    path, head = llama
    runner = load_layer_range(path, 1, 4, **RUNNER_KV_LIMITS)
    runner.forward("s", head.embed([1, 7, 8]), 0, "prefill", layers=(2, 4))
    runner.forward("s", head.embed([9]), 3, "decode", layers=(2, 4))
    with pytest.raises(SessionStateError, match="layer 1 has 0 cached tokens"):
        runner.forward("s", head.embed([10]), 4, "decode", layers=(1, 4))
    with pytest.raises(ValueError, match="not inside the loaded range 1-4"):
        runner.forward("s", head.embed([10]), 4, "decode", layers=(0, 4))


def test_lru_eviction_under_the_budget_frees_the_bytes_it_reports(llama):
    path, head = llama
    one_session_bytes = 4 * 6 * KV_BYTES_PER_TOKEN_PER_LAYER  # 4 tokens on 6 layers
    evicted: list[EvictedSession] = []
    runner = load_layer_range(
        path, 0, 5, cache_budget_bytes=2 * one_session_bytes + 100, on_evict=evicted.append, session_ttl_s=SESSION_TTL_S
    )
    for sid in ("a", "b"):
        runner.forward(sid, head.embed([1, 2, 3, 4]), 0, "prefill")
    runner.forward("a", head.embed([1, 2, 3, 4]), 0, "prefill")  # "a" is now the most recently used
    bytes_b = runner.session_bytes("b")
    runner.forward("c", head.embed([1, 2, 3, 4]), 0, "prefill")

    assert evicted == [EvictedSession("b", "budget", bytes_b)]
    assert bytes_b == one_session_bytes
    assert runner.session_ids() == ["a", "c"]
    assert runner.cache_bytes == 2 * one_session_bytes
    assert runner.evictions_total == 1
    with pytest.raises(SessionStateError):
        runner.forward("b", head.embed([5]), 4, "decode")


def test_ttl_evicts_idle_sessions_and_frees_their_bytes(llama):
    path, head = llama
    clock = FakeClock()
    evicted: list[EvictedSession] = []
    runner = load_layer_range(path, 0, 5, session_ttl_s=10.0, clock=clock, on_evict=evicted.append,
                              cache_budget_bytes=KV_BUDGET_BYTES)
    runner.forward("old", head.embed([1, 2, 3]), 0, "prefill")
    clock.now_s += 6
    runner.forward("recent", head.embed([1, 2]), 0, "prefill")
    old_bytes, recent_bytes = runner.session_bytes("old"), runner.session_bytes("recent")
    clock.now_s += 6  # "old" idle 12 s, "recent" 6 s

    assert runner.evict_expired() == [EvictedSession("old", "ttl", old_bytes)]
    assert runner.cache_bytes == recent_bytes
    clock.now_s += 5  # "recent" idle 11 s: dropped when the next step arrives
    runner.forward("new", head.embed([1]), 0, "prefill")
    assert evicted[-1] == EvictedSession("recent", "ttl", recent_bytes)
    assert runner.session_ids() == ["new"]


def test_a_session_larger_than_the_whole_budget_is_refused_before_computing(llama):
    path, head = llama
    runner = load_layer_range(path, 0, 5, cache_budget_bytes=10 * 6 * KV_BYTES_PER_TOKEN_PER_LAYER,
                              session_ttl_s=SESSION_TTL_S)
    with pytest.raises(SessionTooLargeError):
        runner.forward("big", head.embed(list(range(1, 12))), 0, "prefill")
    assert runner.session_ids() == [] and runner.cache_bytes == 0
    runner.forward("fits", head.embed(list(range(1, 11))), 0, "prefill")
    assert runner.session_bytes("fits") == 10 * 6 * KV_BYTES_PER_TOKEN_PER_LAYER


def test_a_step_beyond_the_models_context_is_refused(llama):
    path, head = llama
    runner = load_layer_range(path, 0, 1, **RUNNER_KV_LIMITS)
    context = runner.info.max_positions
    assert context == 256  # the tiny llama's max_position_embeddings
    with pytest.raises(SessionTooLargeError, match="context"):  # before: a prefill of any length ran
        runner.forward("long", torch.zeros(1, context + 1, runner.info.hidden_size), 0, "prefill")
    runner.forward("s", head.embed(list(range(1, context))), 0, "prefill")
    with pytest.raises(SessionTooLargeError, match="context"):
        runner.forward("s", head.embed([1, 2]), context - 1, "prefill")
    runner.forward("s", head.embed([1]), context - 1, "decode")


def test_bad_inputs_are_rejected_at_the_boundary(llama):
    path, head = llama
    runner = load_layer_range(path, 0, 1, **RUNNER_KV_LIMITS)
    good = head.embed([1, 2])
    with pytest.raises(ValueError, match="shape"):
        runner.forward("s", good[0], 0, "prefill")
    with pytest.raises(ValueError, match="shape"):
        runner.forward("s", torch.zeros(1, 2, 32), 0, "prefill")
    with pytest.raises(ValueError, match="kind"):
        runner.forward("s", good, 0, "reset")
    with pytest.raises(ValueError, match="start_pos"):
        runner.forward("s", good, -1, "prefill")
    with pytest.raises(ValueError, match="session_id"):
        runner.forward("", good, 0, "prefill")
    assert runner.session_ids() == []


def test_close_frees_everything_and_refuses_further_work(llama):
    path, head = llama
    runner = load_layer_range(path, 0, 1, **RUNNER_KV_LIMITS)
    runner.forward("s", head.embed([1, 2]), 0, "prefill")
    runner.close()
    assert runner.cache_bytes == 0 and runner.weight_bytes == 0
    with pytest.raises(RunnerClosedError):
        runner.forward("s", head.embed([1, 2]), 0, "prefill")
