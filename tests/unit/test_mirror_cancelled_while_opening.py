"""A mirror whose opening is cancelled (the call's checks end: verification.detach) is closed, so its subscriptions
and the replica's session do not outlive it; so is a fresh witness cancelled while it runs."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

from hearth.services.common.config import HearthSettings
from hearth.services.orchestrator import mirror as mirror_module
from hearth.services.orchestrator.router import Hop


class _ReplicaThatNeverAnswers:
    """A Mirror whose open never ends (cancelled from outside), counting its closes."""

    instances: list["_ReplicaThatNeverAnswers"] = []

    def __init__(self, nc, replica, **options) -> None:
        self.replica = replica
        self.closes = 0
        self.opening = asyncio.Event()
        _ReplicaThatNeverAnswers.instances.append(self)

    @property
    def shard_id(self) -> str:
        return self.replica.shard_id

    async def open(self):
        self.opening.set()
        await asyncio.Event().wait()

    async def close(self) -> None:
        self.closes += 1


def _candidate(shard_id: str, node_id: str):
    return SimpleNamespace(shard_id=shard_id, node_id=node_id, control_subject=f"ctl.{shard_id}", dtype="float32",
                           weights_sha256="w", quantization="none", layer_lo=0, layer_hi=3)


async def test_a_mirror_cancelled_while_it_opens_is_closed(monkeypatch):
    monkeypatch.setattr(mirror_module, "Mirror", _ReplicaThatNeverAnswers)
    _ReplicaThatNeverAnswers.instances.clear()
    router = SimpleNamespace(candidates=lambda model_id: [_candidate("hop", "a"), _candidate("replica", "b")],
                             now=lambda: 0.0, alive=lambda candidate, now: True)
    ctx = SimpleNamespace(router=router, quarantined=set(), settings=HearthSettings(), nc=None, node_id="me")
    model = SimpleNamespace(model_id="m", weights_sha256="w", head=SimpleNamespace(info=SimpleNamespace(hidden_size=8)))
    call = SimpleNamespace(model=model, prompt_ids=[1, 2, 3], pipeline_id="p")
    chain = SimpleNamespace(hops=[Hop("hop", "ctl.hop", "a", 0, 3)], wire_dtype="float32", max_session_tokens=16,
                            sign_open=None)

    opening = asyncio.create_task(mirror_module.open_mirror(ctx, call, chain, 0, set(), random.Random(0)))
    while not _ReplicaThatNeverAnswers.instances:
        await asyncio.sleep(0)
    (replica,) = _ReplicaThatNeverAnswers.instances
    await asyncio.wait_for(replica.opening.wait(), timeout=5)
    opening.cancel()
    await asyncio.gather(opening, return_exceptions=True)

    assert opening.cancelled()
    assert replica.closes == 1


async def test_a_witness_cancelled_while_it_runs_is_closed():
    witness = object.__new__(mirror_module.Mirror)
    witness.fed_pos = 0
    running, closes = asyncio.Event(), []

    async def check(history):
        running.set()
        await asyncio.Event().wait()

    async def close() -> None:
        closes.append(True)

    witness.check, witness.close = check, close
    recorder = SimpleNamespace(span=lambda index, first_pos, last_step: "history")
    span = SimpleNamespace(last_step=3, first_pos=0, end_pos=4)

    witnessing = asyncio.create_task(witness.witness(recorder, 0, span))
    await asyncio.wait_for(running.wait(), timeout=5)
    witnessing.cancel()
    await asyncio.gather(witnessing, return_exceptions=True)

    assert witnessing.cancelled()
    assert closes == [True]
