"""AnswerWarmUps: at most its limit of warm-ups at once (the others skipped, never queued), each within
`[prefix_cache] warm_up_timeout_s` (a late or failing one counted `failed`), all cancelled by `close`."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hearth.services.orchestrator import answer_kv
from hearth.services.orchestrator.answer_kv import AnswerWarmUps
from hearth.services.orchestrator.metrics import answer_warm_ups_total


def counted(outcome: str) -> float:
    return answer_warm_ups_total.labels(outcome)._value.get()


def context(timeout_s: float):
    return SimpleNamespace(settings=SimpleNamespace(prefix_cache=SimpleNamespace(warm_up_timeout_s=timeout_s)))


def builder(name: str):
    return SimpleNamespace(call=SimpleNamespace(pipeline_id=name))


async def test_warm_ups_are_bounded_timed_out_counted_and_cancelled_on_close(monkeypatch):
    started, release = [], asyncio.Event()

    async def warm_up(ctx, builder, hops):
        started.append(builder.call.pipeline_id)
        if builder.call.pipeline_id == "broken":
            raise RuntimeError("a hop went away")
        await release.wait()
        return answer_kv.KEPT

    monkeypatch.setattr(answer_kv, "warm_up", warm_up)
    before = {outcome: counted(outcome) for outcome in ("kept", "failed", "skipped")}
    warm_ups = AnswerWarmUps(limit=2)
    ctx = context(timeout_s=60.0)
    warm_ups.start(ctx, builder("a"), [])
    warm_ups.start(ctx, builder("b"), [])
    warm_ups.start(ctx, builder("c"), [])  # beyond the limit: skipped, not queued
    await asyncio.sleep(0.05)
    assert started == ["a", "b"] and counted("skipped") == before["skipped"] + 1
    release.set()
    await asyncio.sleep(0.05)
    assert counted("kept") == before["kept"] + 2

    release.clear()
    warm_ups.start(context(timeout_s=0.01), builder("late"), [])
    warm_ups.start(ctx, builder("broken"), [])
    await asyncio.sleep(0.2)
    assert counted("failed") == before["failed"] + 2
    warm_ups.start(ctx, builder("at-shutdown"), [])
    await asyncio.sleep(0.05)
    await asyncio.wait_for(warm_ups.close(), timeout=5)
    assert counted("kept") == before["kept"] + 2 and not warm_ups._tasks


async def test_a_call_needing_blocks_a_warm_up_brings_in_waits_for_it_and_no_longer_than_its_deadline():
    warm_ups = AnswerWarmUps()
    announced = SimpleNamespace(kept=SimpleNamespace(hashes=["p0"]), warm_up=SimpleNamespace(hashes=["p0", "a1"]))
    warm_ups.expect(announced, timeout_s=60.0)
    await asyncio.wait_for(warm_ups.settle(["p0", "x1"]), 1)  # only the prompt's block, kept already: no wait
    waiting = asyncio.ensure_future(warm_ups.settle(["p0", "a1", "n2"]))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    warm_ups.forget(announced)
    await asyncio.wait_for(waiting, 1)
    late = SimpleNamespace(kept=None, warm_up=SimpleNamespace(hashes=["b0"]))
    warm_ups.expect(late, timeout_s=0.05)
    await asyncio.wait_for(warm_ups.settle(["b0"]), 1)  # never over: waited for until its deadline only
    await asyncio.wait_for(warm_ups.settle(["b0"]), 0.02)  # and forgotten after it
