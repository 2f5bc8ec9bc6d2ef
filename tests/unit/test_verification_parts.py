"""The pieces of checking shard hosts, without a mesh: how two outputs are compared, guards that learn only from
confirmed outputs, what a chain's record hands a check and waits for from its taps, the steps a mirror sends its
replica, and a call going back to before a refuted step."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from hearth.inference.activation_compare import first_mismatch, looser_dtype, position_errors, tolerance_for
from hearth.inference.detokenizer import TextDelta
from hearth.protocol.chat import ChatParams, ChatRequest
from hearth.services.orchestrator.call import Call
from hearth.services.orchestrator.guards import RangeGuards
from hearth.services.orchestrator.mirror import Mirror, serves_range
from hearth.services.orchestrator.prefill import steps_as_sent
from hearth.services.orchestrator.recording import ChainRecorder
from hearth.services.transport import FrameKind, StepInfo, TransportError

HIDDEN = 8
KEY = ("m", 2, 3, "none")


def test_positions_beyond_the_tolerance_are_found_first_one_first():
    reference = torch.randn(1, 6, HIDDEN)
    claimed = reference.clone()
    claimed[0, 4] *= 40
    claimed[0, 5, 0] = float("nan")
    errors = position_errors(claimed, reference)
    assert errors[:4].max() == 0 and errors[4] == pytest.approx(39, rel=1e-4) and math.isinf(errors[5])
    assert first_mismatch(errors, tolerance_for("cpu", "float32")) == 4
    assert first_mismatch(position_errors(reference, reference), 1e-9) is None


def test_outputs_of_other_shapes_cannot_be_compared():
    with pytest.raises(ValueError):
        position_errors(torch.zeros(1, 2, HIDDEN), torch.zeros(1, 3, HIDDEN))


def test_rounding_anywhere_loosens_the_tolerance_and_full_fp32_catches_a_lie_of_one_percent():
    exact = tolerance_for("cpu", "float32")
    assert exact < 1e-2, "a lie of 1 % per position (scale=1.01) must not pass full-precision float32"
    assert tolerance_for("cpu", "bfloat16") > exact and tolerance_for("cpu", "float32", "int8") > exact
    assert tolerance_for("cpu", "float32", wire_dtype="fp16") > exact
    assert tolerance_for("tpu", "float32") >= tolerance_for("cpu", "float32", "int4/g32")


def test_a_guard_judges_only_once_confirmed_outputs_taught_it_and_then_both_ways():
    guards = RangeGuards(margin=4.0, min_positions=3)
    confirmed = torch.ones(1, 2, HIDDEN)
    guards.learn(KEY, confirmed)
    assert not guards.learned(KEY) and not guards.suspect(KEY, confirmed * 1000)
    guards.learn(KEY, confirmed * 2)
    assert guards.learned(KEY)
    assert not guards.suspect(KEY, confirmed * 1.5)
    assert guards.suspect(KEY, confirmed * 40)  # far above
    assert guards.suspect(KEY, confirmed / 40)  # far below: no lower bound would let zeros through
    assert guards.suspect(KEY, torch.full((1, 1, HIDDEN), float("inf")))
    assert not guards.suspect(("m", 0, 1, "none"), confirmed * 40), "another range has learned nothing"


def test_what_passes_unconfirmed_teaches_a_guard_nothing():
    guards = RangeGuards(margin=4.0, min_positions=1)
    guards.learn(KEY, torch.ones(1, 1, HIDDEN))
    for _ in range(10):  # a liar ratcheting up, a little at a time: each suspect output is checked, never learned
        assert guards.suspect(KEY, torch.ones(1, 1, HIDDEN) * 5)


def one_hop_recorder() -> ChainRecorder:
    return ChainRecorder(None, "p-test", ["h0"], link_keys=[None, None], sealed=False, step_limits=None)


def step(recorder: ChainRecorder, number: int, kind: FrameKind, pos: int, tokens: int) -> torch.Tensor:
    hidden = torch.randn(1, tokens, HIDDEN)
    info = StepInfo(session="s1", step=number, kind=kind, pos=pos)
    recorder.sent(info, hidden)
    recorder.completed(info, hidden * 2)
    return hidden


def test_a_mirror_sends_recorded_positions_as_the_call_did_one_kind_per_step():
    prefill, decode, replay = FrameKind.prefill, FrameKind.decode, FrameKind.replay
    # A prompt of 5, two decode steps; then (after a failover) a re-prefill: prompt chunks, 3 replayed tokens.
    kinds = [prefill] * 5 + [decode] * 2 + [prefill] * 5 + [replay] * 3 + [decode]
    assert steps_as_sent(len(kinds), kinds, 4) == [
        (0, 4, prefill), (4, 5, prefill), (5, 6, decode), (6, 7, decode), (7, 11, prefill), (11, 12, prefill),
        (12, 15, replay), (15, 16, decode)]
    assert steps_as_sent(8, [replay] * 2, 0) == [(0, 2, replay), (2, 8, prefill)]
    assert steps_as_sent(3, (), 0) == [(0, 3, prefill)]


async def test_a_mirror_checks_a_span_as_the_hop_ran_it_and_its_decoded_positions_as_replays():
    recorder = one_hop_recorder()
    for number, (pos, tokens) in enumerate([(0, 4), (4, 2)], start=1):  # a prompt of 6 in chunks of 4
        hidden = torch.randn(1, tokens, HIDDEN)
        info = StepInfo(session="s1", step=number, kind=FrameKind.prefill, pos=pos, prompt_tokens=6)
        recorder.sent(info, hidden)
        recorder.completed(info, hidden * 2)
    for number in range(3, 6):
        step(recorder, number, FrameKind.decode, number + 3, 1)
    sent = []

    class Replica:  # the mirror's chain: takes replay steps, answers what it was sent
        replay_steps = True

        async def step(self, kind, pos, hidden, prompt_tokens=None):
            sent.append((kind, pos, hidden.shape[1], prompt_tokens))
            return hidden

    mirror = Mirror.__new__(Mirror)
    mirror.chain, mirror.chunk_tokens, mirror.fed_pos = Replica(), 3, 0
    span = recorder.span(0, 0, upto_step=5)
    assert span.prompt_tokens == 6
    assert torch.equal(await mirror.check(span), span.inputs)
    prefill, replay = FrameKind.prefill, FrameKind.replay
    # The prompt's chunks told its length (LongRoPE picks its factors by it); the decoded tokens replayed, chunked.
    assert sent == [(prefill, 0, 3, 6), (prefill, 3, 3, 6), (replay, 6, 3, None)]

    # A replica that takes no replay steps decodes them one by one again, as the hop did.
    Replica.replay_steps, mirror.fed_pos = False, 0
    sent.clear()
    assert torch.equal(await mirror.check(span), span.inputs)
    decode = FrameKind.decode
    assert sent == [(prefill, 0, 3, 6), (prefill, 3, 3, 6), (decode, 6, 1, None), (decode, 7, 1, None),
                    (decode, 8, 1, None)]


def test_a_record_hands_a_check_the_positions_since_its_last_one_in_order():
    recorder = one_hop_recorder()
    prompt = step(recorder, 1, FrameKind.prefill, 0, 5)
    first = step(recorder, 2, FrameKind.decode, 5, 1)
    second = step(recorder, 3, FrameKind.decode, 6, 1)
    whole = recorder.span(0, 0, upto_step=3)
    assert (whole.first_pos, whole.end_pos, whole.last_step) == (0, 7, 3)
    assert torch.equal(whole.inputs, torch.cat([prompt, first, second], dim=1))
    assert torch.equal(whole.outputs, whole.inputs * 2)
    assert whole.kinds == (FrameKind.prefill,) * 5 + (FrameKind.decode,) * 2
    since = recorder.span(0, 3, upto_step=2)  # from inside the prompt, up to step 2 only
    assert (since.first_pos, since.end_pos) == (3, 6)
    assert torch.equal(since.inputs, torch.cat([prompt[:, 3:], first], dim=1))
    assert recorder.span(0, 7, upto_step=3) is None, "nothing new"


def test_a_chain_that_starts_again_from_position_zero_voids_its_record():
    recorder = one_hop_recorder()
    step(recorder, 1, FrameKind.prefill, 0, 4)
    generation = recorder.generation
    again = step(recorder, 2, FrameKind.prefill, 0, 5)  # a re-prefill after an eviction
    assert recorder.generation == generation + 1
    assert torch.equal(recorder.span(0, 0, upto_step=2).inputs, again)


def test_a_step_whose_output_never_came_leaves_a_hole_no_check_reads_across():
    recorder = one_hop_recorder()
    step(recorder, 1, FrameKind.prefill, 0, 3)
    recorder.sent(StepInfo(session="s1", step=2, kind=FrameKind.decode, pos=3), torch.randn(1, 1, HIDDEN))
    step(recorder, 3, FrameKind.decode, 4, 1)
    assert recorder.span(0, 0, upto_step=3) is None
    assert recorder.span(0, 0, upto_step=1).end_pos == 3


class _Texts:
    def push(self, token_id: int) -> TextDelta:
        return TextDelta(token_id=token_id, text=f"<{token_id}>")

    def finish(self, reason: str) -> TextDelta:
        return TextDelta(token_id=-1, text="", finished=True, finish_reason=reason)


def sampling_call(**request) -> Call:
    model = SimpleNamespace(head=SimpleNamespace(text_stream=lambda params, prompt_ids: _Texts()))
    client = SimpleNamespace(tokens_sent=0)
    return Call(request=ChatRequest(prompt="hello", max_tokens=32, params=ChatParams(verify="sampled"), **request),
                model=model, client=client)


def sample(call: Call, probabilities: torch.Tensor) -> int:
    call.before_sampling()
    token = int(torch.multinomial(probabilities, 1, generator=call.generator))
    call.accept(token, torch.zeros(1, 1, HIDDEN))
    call.client.tokens_sent += 1
    return token


def test_a_call_that_goes_back_draws_again_what_it_drew_before():
    probabilities = torch.full((50,), 1 / 50)
    call = sampling_call(temperature=1.0, seed=7)
    drawn = [sample(call, probabilities) for _ in range(8)]
    call.rewind(3)
    assert call.generated == drawn[:3] and call.client.tokens_sent == 3 and call.finish_reason is None
    assert [sample(call, probabilities) for _ in range(5)] == drawn[3:]


def test_going_back_replays_the_kept_tokens_text_and_refuses_to_keep_what_never_came():
    call = sampling_call()
    for token in (5, 6, 7):
        call.accept(token, torch.zeros(1, 1, HIDDEN))
    call.rewind(1)
    assert call.generated == [5]
    assert call.accept(9, torch.zeros(1, 1, HIDDEN)).text == "<9>"
    with pytest.raises(ValueError):
        call.rewind(5)


def test_a_record_past_its_budget_stops_and_its_chain_is_not_checked_any_more():
    step_bytes = 4 * HIDDEN * 4 * 2  # four positions of float32, recorded as one hop's input and output
    recorder = ChainRecorder(None, "p-test", ["h0"], link_keys=[None, None], sealed=False, step_limits=None,
                             budget_bytes=step_bytes + 1)
    step(recorder, 1, FrameKind.prefill, 0, 4)
    assert not recorder.broken
    step(recorder, 2, FrameKind.decode, 4, 1)
    assert recorder.broken == {0} and recorder.span(0, 0, upto_step=2).end_pos == 4


class _ScriptedTap:
    """A tap that hands over the steps it was given, in order, then times out; each told as `recorder` sent it, or
    as `told` says (step number -> StepInfo)."""

    def __init__(self, steps: list[int], recorder: ChainRecorder, told: dict[int, StepInfo] | None = None) -> None:
        self.steps = list(steps)
        self.handed = 0
        self.recorder = recorder
        self.told = told or {}

    async def next_step(self, timeout_s: float):
        if not self.steps:
            raise TransportError("tap timed out")
        self.handed += 1
        number = self.steps.pop(0)
        sent = self.recorder.steps[number]
        info = self.told.get(number) or StepInfo(session="s1", step=number, kind=sent.kind, pos=sent.pos,
                                                 prompt_tokens=sent.prompt_tokens)
        return SimpleNamespace(session="s1", step=number, tensor=torch.zeros(1, 1, HIDDEN), info=info)

    def take_ready(self) -> list:
        return []


async def test_settling_waits_for_the_inputs_taps_have_not_filed_and_marks_a_hop_whose_tap_missed_one():
    recorder = ChainRecorder(None, "p-test", ["h0", "h1", "h2"], link_keys=[None, None, None], sealed=False,
                             step_limits=None)
    recorder._session = "s1"
    recorder._taps = [_ScriptedTap([1, 2, 3], recorder), _ScriptedTap([1, 2], recorder)]
    for number, kind, pos in ((1, FrameKind.prefill, 0), (2, FrameKind.decode, 4), (3, FrameKind.decode, 5)):
        recorder.sent(StepInfo(session="s1", step=number, kind=kind, pos=pos), torch.zeros(1, 1, HIDDEN))

    await recorder.settled(2, timeout_s=1.0)
    assert [tap.handed for tap in recorder._taps] == [2, 2] and not recorder.broken
    await recorder.settled(2, timeout_s=1.0)
    assert [tap.handed for tap in recorder._taps] == [2, 2], "filed steps are not waited for again"
    await recorder.settled(3, timeout_s=1.0, hops={1})
    assert recorder._taps[0].handed == 3 and not recorder.broken
    await recorder.settled(3, timeout_s=1.0)
    assert recorder.broken == {2}, "hop 2's tap never brought step 3"

    # A re-prefill from position 0 starts a new record: nothing of the old one is waited for.
    recorder.sent(StepInfo(session="s1", step=4, kind=FrameKind.prefill, pos=0), torch.zeros(1, 5, HIDDEN))
    recorder._taps = [_ScriptedTap([4], recorder), _ScriptedTap([4], recorder)]
    await recorder.settled(4, timeout_s=1.0)
    assert [tap.handed for tap in recorder._taps] == [1, 1] and not recorder.broken


@pytest.mark.parametrize("told", [
    {"kind": FrameKind.prefill, "pos": 0, "prompt_tokens": 80},  # another prompt length: other LongRoPE factors
    {"kind": FrameKind.prefill, "pos": 0, "prompt_tokens": None},
    {"kind": FrameKind.replay, "pos": 0, "prompt_tokens": None},
    {"kind": FrameKind.prefill, "pos": 1, "prompt_tokens": 8},
])
async def test_a_hop_told_another_step_than_the_orchestrator_sent_is_not_checked_against_what_was_sent(told):
    # Hop 0 passes step 1 on to hop 1 with a header of its own making: checked against the recorded header, the honest
    # hop 1 would compute otherwise than its replica and be accused.
    recorder = ChainRecorder(None, "p-test", ["h0", "h1", "h2"], link_keys=[None, None, None], sealed=False,
                             step_limits=None)
    recorder._session = "s1"
    recorder.sent(StepInfo(session="s1", step=1, kind=FrameKind.prefill, pos=0, prompt_tokens=8),
                  torch.zeros(1, 8, HIDDEN))
    forged = {1: StepInfo(session="s1", step=1, **told)}
    recorder._taps = [_ScriptedTap([1], recorder, told=forged), _ScriptedTap([1], recorder)]
    await recorder.settled(1, timeout_s=1.0)
    assert recorder.broken == {1}


def test_a_hops_own_dtype_label_neither_hides_it_from_checks_nor_tightens_an_honest_one():
    """Before, a mirror had to advertise the hop's dtype: a float32 hop advertising `float64` (or a dtype no replica
    had) was never checked, even at verify=all. Any dtype's replica checks it now, by the looser tolerance."""
    replica = SimpleNamespace(weights_sha256="w", quantization="none", dtype="float32", layer_lo=0, layer_hi=7)
    assert serves_range(replica, "w", "none", None, 2, 5)
    assert not serves_range(replica, "w", "none", "bfloat16", 2, 5)  # canaries still ask for their own dtype
    assert looser_dtype("float64", "float32") == "float64"  # an unknown label gets the loosest bound, no escape
    assert looser_dtype("float32", "bfloat16") == "bfloat16" and looser_dtype(None, "float32") == "float32"
    assert tolerance_for(None, looser_dtype("float32", "float32")) == tolerance_for(None, "float32")
