"""A step sent to a hop its shard closed (its watchdog did, or it dropped the hops of an orchestrator whose key the
event log retired) is never taken in: the stall watch's gone check reads, in the shard's `stat`, that the pipeline is
no longer open there and fails the step at once as `evicted`, saying so. Before, the shard answered the probe and the
step waited out the step timeout (30 s by default) before failing as `stalled`."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from hearth.protocol.control import ShardStat
from hearth.services.common.config import TransportSettings
from hearth.services.orchestrator.router import Hop
from hearth.services.orchestrator.stall import StallWatch
from hearth.services.transport import AckObserver, FrameKind, StepInfo

PIPELINE = "pipe-closed"


class _ShardAnswers:
    """A connection on which every shard answers `stat`, listing `open_pipelines` (None: an answer without the
    field, as a shard that does not say which pipelines it holds)."""

    def __init__(self, open_pipelines: list[str] | None) -> None:
        self.open_pipelines = open_pipelines

    async def request(self, subject: str, payload: bytes, timeout: float) -> SimpleNamespace:
        stat = json.loads(ShardStat(shard_id="shard-0", active_streams=0, cached_sessions=0,
                                    cache_bytes=0).model_dump_json())
        if self.open_pipelines is None:
            del stat["open_pipelines"]
        else:
            stat["open_pipelines"] = self.open_pipelines
        return SimpleNamespace(data=json.dumps(stat).encode())


async def _failure_of_a_held_step(open_pipelines: list[str] | None):
    hops = [Hop(shard_id="shard-0", control_subject="hearth.ctl.n0.shard-0", node_id="n0", layer_lo_to_run=0,
                layer_hi_to_run=3)]
    transport = TransportSettings(step_timeout_s=30.0, gone_check_after_s=0.5)
    watch = StallWatch(_ShardAnswers(open_pipelines), hops, AckObserver(None, PIPELINE, sink_hop=1),  # type: ignore
                       transport, pipeline_id=PIPELINE)
    # Sent 2 s ago, never acked: past the gone check, far from the step timeout.
    sent_at = time.monotonic() - 2.0
    return await watch.check(StepInfo(session="s", step=5, kind=FrameKind.decode, pos=9), sent_at, 30.0)


async def test_a_step_held_by_a_shard_that_closed_its_hop_fails_at_once_saying_so():
    failure = await _failure_of_a_held_step(["another-pipeline"])
    assert failure is not None and (failure.kind, failure.shard_id) == ("evicted", "shard-0")
    assert "step 5" in failure.reason and "no longer open there" in failure.reason


async def test_a_step_held_by_a_shard_that_still_holds_its_hop_waits_for_the_step_timeout():
    assert await _failure_of_a_held_step([PIPELINE, "another-pipeline"]) is None
    assert await _failure_of_a_held_step(None) is None
