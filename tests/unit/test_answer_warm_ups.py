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
