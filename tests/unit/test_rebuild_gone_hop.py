"""A call whose broker connection came back rebuilds its hops; one hop that still has no responder once the others had
time to come back with the broker (its host died meanwhile, or is still starting) is failed over around, not waited
for until `broker_wait_s` ends the call `pipeline_stalled` (hearth/services/orchestrator/pipeline.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from hearth.protocol.chat import ChatRequest
from hearth.services.common.config import load_settings
from hearth.services.orchestrator.call import Call, CallStatus
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.orchestrator.pipeline import PipelineRun
from hearth.services.orchestrator.router import Hop
from tests.orchestrator_stand_ins import RecordingClient

HOPS = [Hop(shard_id=f"s{index}", control_subject=f"test.control.s{index}", node_id=f"n{index}", layer_lo_to_run=index,
            layer_hi_to_run=index) for index in range(2)]
BROKER_WAIT_S = 4.0
RESUBSCRIBE_GRACE_S = 0.3


class _HopGoneChain:
    """Every reopen finds hop 1 without a responder: its host did not come back with the broker."""

    def __init__(self, hops: list[Hop]) -> None:
        self.hops = hops

    async def open(self) -> StepFailure | None:
        return StepFailure("gone", self.hops[1].shard_id, "no responder on its control subject")

    async def close(self) -> None:
        return None


class _Outbox:
    def __init__(self) -> None:
        self.events: list = []

    async def record(self, event) -> None:
        self.events.append(event)


async def test_a_hop_gone_after_the_broker_came_back_is_failed_over_around_before_broker_wait_s():
    settings = load_settings(orchestrator={"broker_wait_s": BROKER_WAIT_S,
                                           "client_resubscribe_grace_s": RESUBSCRIBE_GRACE_S},
                             nats={"reconnect_wait_s": 0.05})
    ctx = SimpleNamespace(settings=settings, nc=SimpleNamespace(is_connected=True), outbox=_Outbox(), node_id="orch",
                          proved_wrong=[])
    call = Call(request=ChatRequest(request_id="r1", model="m", prompt="hello", max_tokens=4),
                model=SimpleNamespace(model_id="m"), client=RecordingClient(), status=CallStatus.recovering)
    run = PipelineRun(call, ctx)
    run.builder = SimpleNamespace(over=_HopGoneChain)
    started = time.monotonic()
    failure = StepFailure("broker", None, "the connection to the NATS broker was lost while step 3 was out")

    outcome = await run._rebuild(HOPS, failure)

    assert call.status is not CallStatus.aborted, call.client.sent
    assert outcome is not None and outcome.kind == "gone" and outcome.shard_id == "s1", outcome
    assert time.monotonic() - started < BROKER_WAIT_S / 2
