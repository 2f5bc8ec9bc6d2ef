"""A hop's report against the hop before it is settled by a check of the accused (CallVerifier.check_report), which
may come while a background check of the same hop runs on the same mirror: the two must not feed the mirror the same
positions at once (a replica's session runs each position once, in order; a real Mirror refuses a run that does not
start where it stopped)."""

from __future__ import annotations

import asyncio

from hearth.services.orchestrator import mirrored_checks
from hearth.services.transport import FrameKind
from tests.unit.test_verify_gaps import LIAR, StandInMirror, run_step, verifier_of


class HeldMirror(StandInMirror):
    """An honest replica whose checks wait for `release`; it refuses a run that does not start where it stopped,
    as Mirror.run does, and counts the checks running on it at once."""

    def __init__(self, node: str) -> None:
        super().__init__(node)
        self.release = asyncio.Event()
        self.running = self.most_at_once = 0
        self.runs: list[tuple[int, int]] = []

    async def check(self, span):
        if span.first_pos != self.fed_pos:
            raise ValueError(f"a mirror fed up to position {self.fed_pos} cannot run from {span.first_pos}")
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            await self.release.wait()
        finally:
            self.running -= 1
        self.runs.append((span.first_pos, span.end_pos))
        return await super().check(span)


async def until(condition, turns: int = 200) -> None:
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("never came")


async def test_a_report_check_waits_for_the_background_check_on_the_same_mirror(monkeypatch):
    mirror = HeldMirror("replica")

    async def open_mirror(ctx, call, chain, index, avoid, chance):
        return mirror

    monkeypatch.setattr(mirrored_checks, "open_mirror", open_mirror)
    verifier, recorder, proved_wrong = await verifier_of("sampled")
    run_step(recorder, 1, FrameKind.prefill, 0, 3)
    verifier.after_step()  # the chain's first step, the range's guard not learned: a background check starts
    await until(lambda: mirror.running == 1)
    report = asyncio.create_task(verifier.check_report(LIAR.shard_id))
    for _ in range(20):  # the report's check gets every chance to reach the mirror
        await asyncio.sleep(0)
    mirror.release.set()
    await asyncio.wait_for(report, timeout=5)
    assert await verifier.settle() is None
    assert mirror.most_at_once == 1, "two checks fed the mirror at once"
    assert mirror.runs == [(0, 3)], "each position runs once on the mirror"
    (summary,) = verifier.summaries()
    assert [(shard.shard_id, shard.verified_positions) for shard in summary.shards
            if shard.shard_id == LIAR.shard_id] == [(LIAR.shard_id, 3)]
    assert proved_wrong == []


async def test_a_report_check_gives_up_when_the_running_check_does_not_end(monkeypatch):
    mirror = HeldMirror("stuck")  # never released

    async def open_mirror(ctx, call, chain, index, avoid, chance):
        return mirror

    monkeypatch.setattr(mirrored_checks, "open_mirror", open_mirror)
    verifier, recorder, _ = await verifier_of("sampled")
    verifier.settings.settle_timeout_s = 0.2
    run_step(recorder, 1, FrameKind.prefill, 0, 3)
    verifier.after_step()
    await until(lambda: mirror.running == 1)
    await asyncio.wait_for(verifier.check_report(LIAR.shard_id), timeout=5)
    assert mirror.most_at_once == 1
    await verifier.detach()  # cancels the stuck check
    assert mirror.running == 0
