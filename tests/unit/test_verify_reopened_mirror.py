"""A mirror lost after a chain's bounded record forgot its first positions cannot be replaced by a fresh replica: it
could not be fed the hop's history. So a call whose record may forget feeds one replica more than its level asks
from the start (at `vote` a third beside the two), which takes a failed mirror's place; without it the hop is checked
by the mirrors it has left, and a hop checked by fewer than its level asks leaves the call `unmet`, never `met`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hearth.services.orchestrator import mirrored_checks
from hearth.services.orchestrator.hop_checks import HopChecks
from hearth.services.orchestrator.metrics import verification_checks_total
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.transport import FrameKind
from tests.unit.test_verify_gaps import HIDDEN, LIAR, PROMPT, STEP_BYTES, StandInMirror, run_step, verifier_of

BUDGET = 10 * STEP_BYTES  # far less than the call's session may grow to: the record forgets what checks read
LOST_AT = 20  # the position from which a mirror stops answering (the record forgot the first decoded ones by then)
LIE_AT = 25  # the step (position LIE_AT + 1) the hop lies at, after the mirror was lost


class FailsLater(StandInMirror):
    """An honest replica that stops answering once asked to check position `LOST_AT` or later."""

    async def check(self, span):
        if span.end_pos > LOST_AT:
            return StepFailure("stalled", self.shard_id, "did not answer")
        return await super().check(span)


@pytest.fixture
def replicas(monkeypatch):
    """The replicas `open_mirror` hands out, in turn, while there are any."""
    queue: list[StandInMirror] = []

    async def open_mirror(ctx, call, chain, index, avoid, chance):
        return queue.pop(0) if queue else None

    monkeypatch.setattr(mirrored_checks, "open_mirror", open_mirror)
    return queue


async def answer(verifier, recorder, steps: int = 30, lie_at: int | None = LIE_AT):
    """A prompt, then `steps` decoded positions, each followed by its checks; the refutation, if any."""
    verifier.prefill_chunk_tokens(0, torch.zeros(1, PROMPT, HIDDEN))  # the session may outgrow the record
    run_step(recorder, 1, FrameKind.prefill, 0, PROMPT)
    verifier.after_step()
    assert await verifier.verify_step() is None
    for number in range(2, steps + 2):
        run_step(recorder, number, FrameKind.decode, PROMPT + number - 2, 1, lie=number == lie_at)
        verifier.after_step()
        # At `sampled` the checks run beside the call: waited for here, so that the record forgets as they read.
        refuted = await (verifier.settle() if verifier.level == "sampled" else verifier.verify_step())
        if refuted is not None:
            return refuted
    return await verifier.settle()


def forgotten_count() -> float:
    return verification_checks_total.labels("history_forgotten")._value.get()


async def test_a_vote_whose_mirror_fails_after_the_record_forgot_goes_on_with_the_replica_fed_beside_them(replicas):
    replicas += [FailsLater("first"), StandInMirror("second"), StandInMirror("third"), StandInMirror("fourth")]
    verifier, recorder, proved_wrong = await verifier_of("vote", budget_bytes=BUDGET)
    refuted = await answer(verifier, recorder)
    assert recorder.forgot_to > 0, "the record forgot positions before the mirror was lost"
    assert refuted is not None and refuted.shard_id == LIAR.shard_id and refuted.rewind_to == PROMPT + LIE_AT - 2
    assert refuted.kind == "refuted" and proved_wrong == [LIAR.shard_id], "two mirrors still outvote the hop"
    assert [m.shard_id for m in replicas] == ["m:0-3@fourth"], "no fresh replica opened that could not be fed"
    assert verifier.outcome() == "met"


async def test_a_vote_left_with_one_mirror_is_still_checked_by_it_and_said_unmet(replicas):
    replicas += [FailsLater("first"), StandInMirror("second")]  # no third replica to feed beside them
    verifier, recorder, proved_wrong = await verifier_of("vote", budget_bytes=BUDGET)
    forgotten_before = forgotten_count()
    refuted = await answer(verifier, recorder)
    # The lie is still caught (no witness can be fed the forgotten positions: disputed, routed around).
    assert refuted is not None and refuted.shard_id == LIAR.shard_id and refuted.rewind_to == PROMPT + LIE_AT - 2
    assert refuted.kind == "disputed" and proved_wrong == []
    assert verifier.outcome() == "unmet"
    assert "forgot" in verifier.found.unmet[LIAR.shard_id] and forgotten_count() > forgotten_before
    assert not recorder.broken, "no unfed mirror holds the record back until it runs out of room"


@pytest.mark.parametrize("level", ["all", "sampled"])
async def test_a_hop_whose_mirrors_all_fail_after_the_record_forgot_leaves_the_call_unmet(replicas, level):
    # Its mirror and the replica fed beside it both fail: no fresh one can be fed the forgotten positions, so the hop
    # goes unchecked from there, and the call says so (at `sampled` it had said `met`).
    replicas += [FailsLater("first"), FailsLater("second"), StandInMirror("third")]
    verifier, recorder, _ = await verifier_of(level, budget_bytes=BUDGET, sample_rate=1.0)
    refuted = await answer(verifier, recorder, steps=LOST_AT, lie_at=None)
    assert refuted is None and recorder.forgot_to > 0
    assert verifier.outcome() == "unmet"
    assert "forgot" in verifier.found.unmet[LIAR.shard_id]
    assert [m.shard_id for m in replicas] == ["m:0-3@third"], "no fresh replica opened that could not be fed"


async def test_a_mirror_that_finished_opening_after_the_record_forgot_is_closed_unblamed():
    # The record goes on forgetting while a mirror opens (other hops' checks move it on): what it would be fed first
    # may be gone by the time it is up. Kept, it would check nothing and hold the record back from position 0.
    recorder = SimpleNamespace(generation=1, forgot_to=0)
    late = StandInMirror("late")
    closed: list[str] = []

    async def close() -> None:
        closed.append(late.shard_id)

    late.close = close

    async def open_mirror(avoid):
        recorder.forgot_to = 5
        return late

    hop = HopChecks()
    assert await hop.mirrors_of_run(recorder, 2, False, open_mirror) == []
    assert hop.unmirrored and closed == [late.shard_id] and late.shard_id not in hop.avoid
