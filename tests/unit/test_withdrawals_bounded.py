"""An orchestrator sends a choice at most max_withdrawals_per_choice tokens_withdrawn frames (the protocol's bound,
which every client holds it to, hearth/services/client/answer_bound.py): a call whose work is refuted once more,
however many failovers `[research.distributed_inference]` allows, ends `shard_unavailable` without withdrawing
again."""

from __future__ import annotations

from types import SimpleNamespace

from hearth.protocol.chat import ChatRequest
from hearth.protocol.chat_frames import PipelineAbortedFrame, TokensWithdrawnFrame, max_withdrawals_per_choice
from hearth.services.common.config import load_settings
from hearth.services.orchestrator.call import Call, CallStatus
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.orchestrator.pipeline import PipelineRun
from tests.orchestrator_stand_ins import RecordingClient
from tests.unit.test_rebuild_gone_hop import _Outbox

PROMPT_TOKENS = 3


class _AlwaysFailsOver(PipelineRun):
    """A call whose every failover finds a chain at once (no hosts are needed to count its withdrawals)."""

    async def _route(self, replacing: StepFailure | None) -> None:
        self.call.failovers += 1
        self._enter(CallStatus.prefilling)


async def test_a_call_withdraws_at_most_the_protocol_s_bound_then_ends_shard_unavailable():
    settings = load_settings(research={"distributed_inference": {"fallback_to_local_after_failures": 1000}})
    ctx = SimpleNamespace(settings=settings, outbox=_Outbox(), node_id="orch", recent_failures=set(),
                          proved_wrong=[])
    call = Call(request=ChatRequest(request_id="r1", model="m", prompt="hello", max_tokens=4),
                model=SimpleNamespace(model_id="m"), client=RecordingClient(), status=CallStatus.decoding)
    call.prompt_ids = list(range(PROMPT_TOKENS))
    run = _AlwaysFailsOver(call, ctx)
    for round_ in range(max_withdrawals_per_choice + 1):
        call.generated[:] = [7, 8, 9]  # the tokens sent again since the last withdrawal
        # A check refuted the step of the first generated token: every token is withdrawn.
        await run._recover(StepFailure("refuted", f"m:0-1@liar{round_}", f"step {round_} refuted",
                                       rewind_to=PROMPT_TOKENS - 1))
    withdrawals = [frame for frame in call.client.sent if isinstance(frame, TokensWithdrawnFrame)]
    assert len(withdrawals) == call.withdrawals == max_withdrawals_per_choice
    aborted = call.client.sent[-1]
    assert isinstance(aborted, PipelineAbortedFrame) and aborted.code == "shard_unavailable", call.client.sent
    assert f"withdrawn {max_withdrawals_per_choice} times already" in aborted.reason
    assert call.status is CallStatus.aborted and call.failovers == max_withdrawals_per_choice
