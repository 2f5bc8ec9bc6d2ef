"""A call's close gives its shards' room back and tells its hops to close whatever fails on the way
(hearth/services/orchestrator/pipeline.py `PipelineRun.close`, answer_kv.py `close_keeping`): keeping the inputs of a
call that ended well for later checks failing (a tensor that does not fit, memory) used to leave the call's streams
counted in ShardLoad for good, so the orchestrator believed those shards fuller than they were (and, once as many
as a shard serves, never routed to it again), and left the hops' sessions open until their idle timeout."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from hearth.protocol.chat import ChatRequest
from hearth.protocol.control import PrefixBlocks
from hearth.services.common.config import load_settings
from hearth.services.orchestrator import answer_kv
from hearth.services.orchestrator.call import Call, CallStatus
from hearth.services.orchestrator.capacity import ShardLoad
from hearth.services.orchestrator.chain import HopChain
from hearth.services.orchestrator.pipeline import PipelineRun


class _Chain(HopChain):
    """A chain over two shards that records how it was closed (no broker)."""

    def __init__(self) -> None:
        self.hops = [SimpleNamespace(shard_id=f"s{index}") for index in range(2)]
        self.closed_keeping: list = []

    async def close(self, keep=None) -> None:
        self.closed_keeping.append(keep)


class _Client:
    def __init__(self) -> None:
        self.client_gone = asyncio.Event()

    async def send(self, frame) -> None:
        pass


async def test_a_failure_keeping_a_finished_calls_inputs_still_closes_its_hops_and_gives_their_room_back(monkeypatch):
    async def keep_fails(kept_inputs, chain, kept):
        raise MemoryError("no room to keep the inputs")

    monkeypatch.setattr(answer_kv, "keep_chain_inputs", keep_fails)
    load = ShardLoad(retry_s=0.5)
    forgotten = []
    ctx = SimpleNamespace(settings=load_settings(), nc=SimpleNamespace(is_connected=True), node_id="orch",
                          proved_wrong=[], load=load, kept_inputs=None,
                          warm_ups=SimpleNamespace(forget=forgotten.append))
    call = Call(request=ChatRequest(request_id="r1", model="m", prompt="hello", max_tokens=4),
                model=SimpleNamespace(model_id="m"), client=_Client(), status=CallStatus.finished)
    run = PipelineRun(call, ctx)
    kept = PrefixBlocks(block_tokens=32, hashes=["0" * 32])
    run.builder = SimpleNamespace(kept=kept, warm_up=None)
    chain = _Chain()
    run.chain = chain
    load.hold(chain.shard_ids)
    run._held = list(chain.shard_ids)

    with pytest.raises(MemoryError):
        await run.close()

    assert [load.held(shard_id) for shard_id in chain.shard_ids] == [0, 0]
    assert len(chain.closed_keeping) == 1  # its hops were told to close (keeping the blocks: only the checks' inputs
    # of them were lost)
    assert forgotten == [run.builder]
