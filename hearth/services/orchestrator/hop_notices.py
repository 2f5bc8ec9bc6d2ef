"""What a hop's notice (hearth/services/transport/notices.py) means for the step it stopped: whom it blames, and whether
that can be verified."""

from __future__ import annotations

from hearth.protocol.control import HopNotice
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.orchestrator.router import Hop


def notice_failure(notice: HopNotice, hops: list[Hop], accusers: set[str]) -> StepFailure:
    """The failure of the step `notice` (its `hop`: an index into `hops`) stopped; `accusers`: the call's shards
    that reported bad input before (one that reports again is routed around itself, and is added here)."""
    if notice.problem == "session_evicted":
        return StepFailure("evicted", hops[notice.hop].shard_id,
                           f"step {notice.step}: its session was evicted: {notice.message}")
    if notice.problem == "step_failed":
        return StepFailure("step_failed", hops[notice.hop].shard_id,
                           f"step {notice.step} failed on it: {notice.message}")
    # Hop i says its input failed a check: an accusation of hop i-1 (of us, for hop 0) that we cannot verify.
    # The step cannot go on, so the accused is routed around for this call (the reporter itself, for hop 0 or
    # when it accused before in this call), but the failure is `reported`: blamed in no event and kept out of
    # no other call's routing (pipeline.py).
    reporter = hops[notice.hop]
    detail = f": {notice.message}" if notice.message else ""
    if notice.hop == 0 or reporter.shard_id in accusers:
        accused = "this orchestrator" if notice.hop == 0 else "the hop before it (its second report)"
        return StepFailure("reported", reporter.shard_id,
                           f"hop {notice.hop} reported that its input from {accused} failed the {notice.check} "
                           f"check{detail} (unverified: the reporter is routed around for this call, not blamed)",
                           check=notice.check)
    accusers.add(reporter.shard_id)
    return StepFailure("reported", hops[notice.hop - 1].shard_id,
                       f"hop {notice.hop} ({reporter.shard_id}) reported that its input from this shard failed "
                       f"the {notice.check} check{detail} (unverified: routed around for this call, not blamed)",
                       check=notice.check)
