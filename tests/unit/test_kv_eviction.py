"""KV caches within a budget: the least recently used session is evicted (LRU) and so is an idle one (TTL); the
evicted session's next step raises SessionEvictedError (the shard's `session_evicted`), and re-prefilling it gives
the same greedy tokens as a session that was never evicted."""

from __future__ import annotations

import pytest

from hearth.inference import SamplingParams, SessionEvictedError, SessionStateError, load_head, load_layer_range
from tests.runner_limits import KV_BUDGET_BYTES, RUNNER_KV_LIMITS, SESSION_TTL_S

from .inference_tiny_models import one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)
from .test_inference_sessions import KV_BYTES_PER_TOKEN_PER_LAYER, FakeClock

GREEDY = SamplingParams(temperature=0.0)


def generate(runner, head, session_id: str, prompt_ids: list[int], new_tokens: int, *, between_steps=None):
    """Greedy tokens; a step answered 'evicted' re-prefills everything known so far, as the orchestrator does."""
    known = list(prompt_ids)
    hidden = runner.forward(session_id, head.embed(known), 0, "prefill")
    tokens, evictions = [], 0
    while len(tokens) < new_tokens:
        tokens.append(head.sample(head.logits(hidden), GREEDY))
        known.append(tokens[-1])
        if between_steps is not None:
            between_steps()
        try:
            hidden = runner.forward(session_id, head.embed([tokens[-1]]), len(known) - 1, "decode")
        except SessionEvictedError:
            evictions += 1
            hidden = runner.forward(session_id, head.embed(known), 0, "prefill")
    return tokens, evictions


@pytest.fixture
def llama(tiny_model_dir):
    path = tiny_model_dir("llama")
    return path, load_head(path)


def test_lru_eviction_answers_evicted_and_a_re_prefill_gives_the_same_tokens(llama):
    path, head = llama
    expected, _ = generate(load_layer_range(path, 0, 5, **RUNNER_KV_LIMITS), head, "alone", [1, 10, 11, 12], 8)
    # Room for one session of up to 14 tokens on 6 layers: a second session evicts the first.
    runner = load_layer_range(path, 0, 5, cache_budget_bytes=14 * 6 * KV_BYTES_PER_TOKEN_PER_LAYER,
                              session_ttl_s=SESSION_TTL_S)
    runner.forward("a", head.embed([1, 10, 11, 12]), 0, "prefill")
    runner.forward("b", head.embed([1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]), 0, "prefill")
    assert runner.session_ids() == ["b"]
    with pytest.raises(SessionEvictedError, match="budget"):
        runner.forward("a", head.embed([5]), 4, "decode")
    # A session the runner never saw is not "evicted": that is a different mistake.
    with pytest.raises(SessionStateError) as never_seen:
        runner.forward("unknown", head.embed([5]), 4, "decode")
    assert not isinstance(never_seen.value, SessionEvictedError)

    # Two sessions taking turns evict each other; each still gets exactly its greedy tokens.
    def other_session_steps():
        runner.forward("other", head.embed([1, 40, 41, 42, 43, 44, 45, 46, 47, 48]), 0, "prefill")

    tokens, evictions = generate(runner, head, "a2", [1, 10, 11, 12], 8, between_steps=other_session_steps)
    assert evictions > 0
    assert tokens == expected
    assert runner.cache_bytes <= runner.cache_budget_bytes


def test_an_idle_session_is_evicted_and_its_re_prefill_gives_the_same_tokens(llama):
    path, head = llama
    expected, _ = generate(load_layer_range(path, 0, 5, **RUNNER_KV_LIMITS), head, "alone", [1, 20, 21], 6)
    clock = FakeClock()
    runner = load_layer_range(path, 0, 5, session_ttl_s=5.0, clock=clock, cache_budget_bytes=KV_BUDGET_BYTES)

    def idle_for_a_while():
        clock.now_s += 6.0
        runner.evict_expired()  # the shard's watchdog does this between steps

    tokens, evictions = generate(runner, head, "s", [1, 20, 21], 6, between_steps=idle_for_a_while)
    assert (tokens, evictions) == (expected, 6)  # every decode step found its session evicted
    clock.now_s += 6.0
    runner.evict_expired()
    with pytest.raises(SessionEvictedError, match="ttl"):
        runner.forward("s", head.embed([5]), 9, "decode")
