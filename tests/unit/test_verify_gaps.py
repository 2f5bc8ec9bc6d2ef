"""Where checks used to leave a gap a liar could count on. At levels `all` and `vote` a check whose mirror failed
is made again at the next step on a fresh mirror; the last step has no next one, so before the answer's last frame
what a failed check left unchecked is checked again, and a lie on the last step is still refuted (its token
withdrawn) rather than reaching the client unchecked. And a chain's record, bounded, forgets what every hop's
checks read rather than stop: a host that sees how long a session may grow cannot lie past the budget unchecked.
A hop that passes a step on told otherwise than it was sent leaves its successor unchecked: the call routes around
it and withdraws what was computed from there."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hearth.services.orchestrator import mirrored_checks
from hearth.services.orchestrator.guards import RangeGuards
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.orchestrator.recording import ChainRecorder
from hearth.services.orchestrator.router import Hop
from hearth.services.orchestrator.verification import CallVerifier
from hearth.services.transport import FrameKind, StepInfo

HIDDEN = 8


class StandInMirror:
    """A replica that computes honestly (doubles its input), or fails to answer its first check."""

    def __init__(self, node: str, *, fails_once: bool = False) -> None:
        self.shard_id, self.dtype, self.fed_pos, self.generation = f"m:0-3@{node}", "float32", 0, 1
        self.fails_once = fails_once
        self.replica = SimpleNamespace(node_id=node)
        self.chain = SimpleNamespace(keep_alive=lambda: None)

    async def check(self, span):
        if self.fails_once:
            self.fails_once = False
            return StepFailure("stalled", self.shard_id, "did not answer")
        self.fed_pos = span.end_pos
        return span.inputs * 2

    async def witness(self, recorder, index, span):
        history = recorder.span(index, 0, span.last_step)
        if history is None:  # the record forgot the first positions: nothing to feed a fresh replica
            return None
        return self, (history.inputs * 2)[:, span.first_pos:span.end_pos]

    async def close(self) -> None:
        return None


@pytest.fixture
def replicas(monkeypatch):
    """The replicas `open_mirror` hands out, in turn: the first fails its check, the others answer."""
    queue = [StandInMirror("first", fails_once=True), StandInMirror("second"), StandInMirror("third")]

    async def open_mirror(ctx, call, chain, index, avoid, chance):
        return queue.pop(0) if queue else None

    monkeypatch.setattr(mirrored_checks, "open_mirror", open_mirror)
    return queue


LIAR = Hop(shard_id="m:0-3@liar", control_subject="c", node_id="liar", layer_lo_to_run=0, layer_hi_to_run=3,
           quantization="none")


async def verifier_of(level: str, budget_bytes: int | None = None, sample_rate: float = 0.0, prompt_tokens: int = 3):
    """A call's verifier at `level` over a one-hop chain on the liar, its record within `budget_bytes`, for a call of
    a prompt of `prompt_tokens`; the list of shards proved wrong."""
    recorder = ChainRecorder(None, "p", ["liar"], link_keys=[None], sealed=False, step_limits=None,
                             budget_bytes=budget_bytes)
    await recorder.start("s")
    chain = SimpleNamespace(hops=[LIAR], recorder=recorder, wire_dtype="auto", max_session_tokens=64, prefix=None)
    proved_wrong: list[str] = []
    ctx = SimpleNamespace(
        node_id="orchestrator", proved_wrong=proved_wrong, prove_wrong=proved_wrong.append,
        guards=RangeGuards(4.0, 16), canaries=SimpleNamespace(keep=lambda canary: None),
        settings=SimpleNamespace(verification=SimpleNamespace(settle_timeout_s=5.0, sample_rate=sample_rate),
                                 transport=SimpleNamespace(step_timeout_s=1.0, probe_timeout_s=1.0)))
    call = SimpleNamespace(request=SimpleNamespace(params=SimpleNamespace(verify=level)), pipeline_id="p",
                           model=SimpleNamespace(model_id="m", weights_sha256="ab" * 32), excluded={},
                           prompt_ids=list(range(prompt_tokens)), known_ids=list(range(prompt_tokens)))

    async def record(event) -> None:
        return None

    verifier = CallVerifier(call, ctx, record)
    await verifier.attach(chain)
    return verifier, recorder, proved_wrong


def run_step(recorder: ChainRecorder, number: int, kind: FrameKind, pos: int, tokens: int, *,
             lie: bool = False) -> None:
    hidden = torch.randn(1, tokens, HIDDEN)
    info = StepInfo(session="s", step=number, kind=kind, pos=pos, prompt_tokens=tokens if pos == 0 else None)
    recorder.sent(info, hidden)
    recorder.completed(info, hidden * (2.02 if lie else 2))  # a lie of 1 %: within the guard, not the tolerance


async def test_a_lie_on_the_last_step_whose_check_failed_is_refuted_before_the_last_frame(replicas):
    verifier, recorder, proved_wrong = await verifier_of("all")
    run_step(recorder, 1, FrameKind.prefill, 0, 3, lie=True)  # the call's only step, its last
    verifier.after_step()
    assert await verifier.verify_step() is None, "its mirror failed: nothing refuted yet"
    refuted = await verifier.settle()
    assert refuted is not None and refuted.kind == "refuted" and refuted.shard_id == LIAR.shard_id
    assert refuted.rewind_to == 0
    assert proved_wrong == [LIAR.shard_id]


PROMPT = 3
STEP_BYTES = HIDDEN * 4 * 2  # one position of float32, recorded as the hop's input and its output


@pytest.mark.parametrize("level", ["all", "sampled"])
async def test_a_lie_past_what_the_record_may_hold_at_once_is_still_refuted(replicas, level):
    # A host sees how long a session may grow (OpenHop's max_session_tokens): had the record stopped at its budget,
    # it could lie at every position past it unchecked. A record holds what the checks have not yet consumed.
    replicas[0].fails_once = False
    verifier, recorder, proved_wrong = await verifier_of(level, budget_bytes=10 * STEP_BYTES)
    verifier.prefill_chunk_tokens(0, torch.zeros(1, PROMPT, HIDDEN))  # as the call does before its prompt goes out
    run_step(recorder, 1, FrameKind.prefill, 0, PROMPT)
    verifier.after_step()
    assert await verifier.verify_step() is None
    for number in range(2, 30):
        run_step(recorder, number, FrameKind.decode, PROMPT + number - 2, 1, lie=number == 25)
        verifier.after_step()
        refuted = await verifier.verify_step() or await verifier.settle()
        if refuted is not None:
            break
    assert refuted is not None and refuted.shard_id == LIAR.shard_id and refuted.rewind_to == PROMPT + 23
    # No fresh witness can be fed the positions the record forgot; the second replica fed beside the mirror from the
    # start (the call's session may outgrow the record) settles it, as on a short answer.
    assert refuted.kind == "refuted" and proved_wrong == [LIAR.shard_id]
    assert recorder.held_bytes <= 10 * STEP_BYTES


class RetellingTap:
    """The tap of hop 1's input: hands over step 1 once, told with another prompt length than it was sent with."""

    def __init__(self, recorder: ChainRecorder) -> None:
        self.recorder, self.handed = recorder, False

    def take_ready(self) -> list:
        if self.handed:
            return []
        self.handed = True
        sent = self.recorder.steps[1]
        told = StepInfo(session="s", step=1, kind=sent.kind, pos=sent.pos, prompt_tokens=80)
        return [SimpleNamespace(session="s", step=1, tensor=torch.zeros(1, PROMPT, HIDDEN), info=told)]

    async def close(self) -> None:
        return None


async def test_a_hop_that_passes_a_step_on_told_otherwise_is_routed_around_and_its_work_withdrawn(replicas):
    # Told another prompt length, a LongRoPE layer rotates otherwise: hop 1 computes what no replica told as the
    # orchestrator sent it would, so it cannot be checked on this chain. Left at that, hop 0 would corrupt every
    # answer through an honest hop 1 (or cover a colluding one) while its own checks pass.
    verifier, _, _ = await verifier_of("sampled")
    recorder = ChainRecorder(None, "p", ["liar", "honest"], link_keys=[None, None], sealed=False, step_limits=None)
    recorder._session = "s"
    recorder._taps = [RetellingTap(recorder)]
    honest = Hop(shard_id="m:4-7@honest", control_subject="c", node_id="honest", layer_lo_to_run=4,
                 layer_hi_to_run=7, quantization="none")
    await verifier.attach(SimpleNamespace(hops=[LIAR, honest], recorder=recorder, wire_dtype="auto",
                                          max_session_tokens=64, prefix=None))
    hidden = torch.randn(1, PROMPT, HIDDEN)
    info = StepInfo(session="s", step=1, kind=FrameKind.prefill, pos=0, prompt_tokens=PROMPT)
    recorder.sent(info, hidden)
    recorder.completed(info, hidden * 2)
    assert recorder.broken == {1}
    failure = verifier.refuted()
    assert failure is not None and failure.shard_id == LIAR.shard_id and failure.rewind_to == 0
    assert failure.kind == "reported" and not failure.verified, "the tap cannot tell which end of the link wrote it"
    assert verifier.refuted() is None, "said once"


async def test_a_record_forgets_no_prompt_step_whose_inputs_a_next_turn_is_checked_from(replicas):
    # What entered each hop over the prompt is kept at the call's end (kept_inputs.py), so that a next turn whose
    # hops begin from the prompt's kept KV can still be mirrored: the record forgets only decoded positions.
    replicas[0].fails_once = False
    verifier, recorder, _ = await verifier_of("all", budget_bytes=10 * STEP_BYTES)
    run_step(recorder, 1, FrameKind.prefill, 0, PROMPT)
    verifier.after_step()
    await verifier.verify_step()
    for number in range(2, 30):
        run_step(recorder, number, FrameKind.decode, PROMPT + number - 2, 1)
        verifier.after_step()
        assert await verifier.verify_step() is None
    assert not recorder.broken and recorder.span(0, 0, 1).positions == PROMPT
    assert recorder.held_bytes <= 10 * STEP_BYTES
