"""The local fallback's sessions share one KV budget (`[shard] kv_cache_budget_mb`, hearth/services/orchestrator/
local_model.py), so one call's prefill can evict another's cache. A LocalChain step on an evicted session answers
`evicted` (a StepFailure, as a hop's `session_evicted` notice does), so the call re-prefills as the recovery policy
says, instead of raising SessionEvictedError out of the call, which ended it `internal_error`."""

from __future__ import annotations

from hearth.inference import load_full
from hearth.services.orchestrator.local_chain import LocalChain
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.orchestrator.prefill import prefill
from hearth.services.orchestrator.recovery import Action, CallCounters, RecoveryLimits, decide
from hearth.services.transport import FrameKind

from .inference_tiny_models import one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures are used by name)

PROMPT_TOKENS = 24


async def test_a_local_session_evicted_by_another_calls_answers_evicted_and_is_re_prefilled(tiny_model_dir):
    probe = load_full(tiny_model_dir("llama"), cache_budget_bytes=1 << 30, session_ttl_s=600)
    ids = list(range(3, 3 + PROMPT_TOKENS))
    hidden = probe.head.embed(ids)
    sizing = LocalChain(probe)
    await prefill(sizing, hidden, 0)
    one_session = probe.runner.session_bytes(sizing.session_id)
    await sizing.close()
    probe.close()
    # Room for one prompt's cache and a little more: a second call's prefill evicts the first's.
    local = load_full(tiny_model_dir("llama"), cache_budget_bytes=one_session + one_session // 2, session_ttl_s=600)
    first, second = LocalChain(local), LocalChain(local)
    try:
        assert not isinstance(await prefill(first, hidden, 8), StepFailure)
        assert not isinstance(await prefill(second, hidden, 8), StepFailure)
        failure = await first.step(FrameKind.decode, PROMPT_TOKENS, local.head.embed([5]))
        assert isinstance(failure, StepFailure) and failure.kind == "evicted", failure
        assert "evicted" in failure.reason
        limits = RecoveryLimits(max_eviction_reprefills=2, fallback_to_local_after_failures=2, max_broker_repairs=3,
                                fallback_to_local=True)
        assert decide(failure, CallCounters(has_hops=False), limits).action is Action.reprefill
        beyond = decide(failure, CallCounters(eviction_reprefills=2, has_hops=False), limits)
        assert beyond.action is Action.abort and beyond.reason == failure.reason  # no hops were ever rebuilt
        # The re-prefill (from position 0, as after a hop's eviction) goes on where it stopped.
        assert not isinstance(await prefill(first, hidden, 8), StepFailure)
        assert not isinstance(await first.step(FrameKind.decode, PROMPT_TOKENS, local.head.embed([5])), StepFailure)
    finally:
        await first.close()
        await second.close()
        local.close()


async def test_a_chunked_local_prefill_stops_at_its_first_failed_chunk(tiny_model_dir):
    class FailsSecondChunk(LocalChain):
        def __init__(self, local) -> None:
            super().__init__(local)
            self.steps = 0

        async def step(self, kind, pos, hidden, prompt_tokens=None):
            self.steps += 1
            if self.steps == 2:
                return StepFailure("evicted", None, "its session was evicted")
            return await super().step(kind, pos, hidden, prompt_tokens)

    local = load_full(tiny_model_dir("llama"), cache_budget_bytes=1 << 30, session_ttl_s=600)
    chain = FailsSecondChunk(local)
    try:
        output = await prefill(chain, local.head.embed(list(range(3, 3 + PROMPT_TOKENS))), 8)
        assert isinstance(output, StepFailure) and chain.steps == 2
    finally:
        await chain.close()
        local.close()
