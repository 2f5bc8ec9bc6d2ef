"""A call's status moves only along its lifecycle (routing, prefilling, decoding, recovering, then one final
status), and the call takes its sampled tokens through its own stop rules."""

from __future__ import annotations

import pytest

from hearth.protocol.chat import ChatRequest
from hearth.services.orchestrator.call import Call, CallStatus


def new_call(**request) -> Call:
    return Call(request=ChatRequest(prompt="hello", **request), model=None, client=None)


def test_a_call_goes_through_a_failover_to_its_end():
    call = new_call()
    path = [CallStatus.routing, CallStatus.prefilling, CallStatus.decoding, CallStatus.recovering,
            CallStatus.routing, CallStatus.prefilling, CallStatus.decoding, CallStatus.finished]
    for status in path:
        call.advance(status)
    assert call.status is CallStatus.finished and call.status.final


@pytest.mark.parametrize("cancelled", [CallStatus.client_gone, CallStatus.past_deadline])
@pytest.mark.parametrize("start", [CallStatus.admitted, CallStatus.routing, CallStatus.decoding])
def test_a_client_can_leave_and_the_deadline_pass_at_any_point_before_the_end(start, cancelled):
    call = new_call()
    for status in [CallStatus.routing, CallStatus.prefilling, CallStatus.decoding]:
        if call.status is start:
            break
        call.advance(status)
    call.advance(cancelled)
    assert call.status is cancelled and call.status.final


def test_a_status_out_of_the_lifecycle_is_refused():
    call = new_call()
    with pytest.raises(RuntimeError):
        call.advance(CallStatus.decoding)  # nothing was prefilled
    call.advance(CallStatus.routing)
    with pytest.raises(RuntimeError):
        call.advance(CallStatus.finished)


def test_an_ended_call_stays_ended():
    call = new_call()
    for status in [CallStatus.routing, CallStatus.recovering, CallStatus.aborted]:
        call.advance(status)
    with pytest.raises(RuntimeError):
        call.advance(CallStatus.client_gone)


def test_the_call_holds_its_sampling_parameters():
    call = new_call(temperature=0.7, top_k=5, seed=3, max_tokens=9, stop=["\n\n"])
    assert (call.params.temperature, call.params.top_k, call.params.seed) == (0.7, 5, 3)
    assert (call.params.max_tokens, call.params.stop) == (9, ("\n\n",))
