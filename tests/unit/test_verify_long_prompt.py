"""A prompt longer than a chain's record holds (`[verification] record_budget_mb`) is checked as it streams: once the
record would pass half its budget, every hop is checked on the chunks it ran so far and the record forgets them, the
next chunk waiting for those checks when it would not fit. A host sees a prompt's length (Hearth-Prompt-Tokens), so
had such prompts gone unchecked, it could lie on exactly those; here a stand-in host does, at every level."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hearth.services.orchestrator import mirrored_checks
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.orchestrator.prefill import prefill
from hearth.services.orchestrator.recording import ChainRecorder
from hearth.services.orchestrator.router import Hop
from hearth.services.transport import FrameKind, StepInfo, TransportError
from tests.unit.test_verify_gaps import HIDDEN, LIAR, STEP_BYTES, StandInMirror, run_step, verifier_of

CHUNK = 4
BUDGET_POSITIONS = 12  # what the record holds of a one-hop chain: its input and output at each position
BUDGET_BYTES = BUDGET_POSITIONS * HIDDEN * 4 * 2
LONG_PROMPT = 40


class LongPromptLiar:
    """A one-hop chain on a host that doubles its input, but (1 % off, within the guard) from position `lie_from` of
    any prompt longer than the record can hold: it reads the prompt's length off each chunk, as a host can."""

    replay_steps = True

    def __init__(self, recorder: ChainRecorder, lie_from: int | None, hops=(LIAR,)) -> None:
        self.hops, self.recorder, self.lie_from = list(hops), recorder, lie_from
        self.transport = SimpleNamespace(max_ready_steps=8)
        self.wire_dtype, self.max_session_tokens, self.prefix, self.reused_tokens = "auto", 64, None, 0
        self._step = 0
        self.most_held = 0

    async def send_step(self, kind: FrameKind, pos: int, hidden: torch.Tensor, *, queued_tokens: int = 0,
                        prompt_tokens: int | None = None):
        self._step += 1
        info = StepInfo(session="s", step=self._step, kind=kind, pos=pos, prompt_tokens=prompt_tokens)
        self.recorder.sent(info, hidden)
        self.most_held = max(self.most_held, self.recorder.held_bytes)
        return SimpleNamespace(info=info, hidden=hidden)

    async def await_step(self, sent) -> torch.Tensor:
        info, hidden = sent.info, sent.hidden
        lies = (self.lie_from is not None and (info.prompt_tokens or 0) > BUDGET_POSITIONS
                and info.pos + hidden.shape[1] > self.lie_from)
        output = hidden * 2
        if lies:
            first = max(0, self.lie_from - info.pos)
            output[:, first:] *= 1.01
        for tap in self.recorder._taps:  # a later hop (honest: doubles its input) got hop 0's output on its link
            tap.ready.append(SimpleNamespace(session="s", step=info.step, tensor=output, info=info))
            output = output * 2
        self.recorder.completed(info, output)
        return output

    async def step(self, kind, pos, hidden, prompt_tokens=None):
        return await self.await_step(await self.send_step(kind, pos, hidden, prompt_tokens=prompt_tokens))


class StandInTap:
    """The tap of hop 1's input: what hop 0 sent on, as the link carried it."""

    def __init__(self) -> None:
        self.ready: list = []

    async def start(self) -> None:
        return None

    def take_ready(self) -> list:
        ready, self.ready = self.ready, []
        return ready

    async def next_step(self, timeout_s: float):
        raise TransportError("nothing more on the link")

    async def close(self) -> None:
        return None


@pytest.fixture
def honest_replicas(monkeypatch):
    queue = [StandInMirror(node) for node in ("first", "second", "third", "fourth")]

    async def open_mirror(ctx, call, chain, index, avoid, chance):
        return queue.pop(0) if queue else None

    monkeypatch.setattr(mirrored_checks, "open_mirror", open_mirror)
    return queue


async def run_long_prompt(level: str, lie_from: int | None, chunk_tokens: int = CHUNK):
    """Prefill a long prompt through the liar as a call does (`chunk_tokens`: `[orchestrator]
    prefill_chunk_tokens`), then the call's checks of that step; (the refutation or None, the verifier, the
    chain)."""
    verifier, recorder, proved_wrong = await verifier_of(level, budget_bytes=BUDGET_BYTES, prompt_tokens=LONG_PROMPT)
    chain = LongPromptLiar(recorder, lie_from)
    await verifier.attach(chain)
    hidden = torch.randn(1, LONG_PROMPT, HIDDEN)
    chunk_tokens = verifier.prefill_chunk_tokens(chunk_tokens, hidden)
    output = await prefill(chain, hidden, chunk_tokens, make_room=verifier.make_room)
    if isinstance(output, StepFailure):
        return output, verifier, chain, proved_wrong
    verifier.after_step()
    refuted = await verifier.verify_step() or await verifier.settle()
    return refuted, verifier, chain, proved_wrong


@pytest.mark.parametrize("level", ["sampled", "all", "vote"])
async def test_a_liar_on_prompts_longer_than_the_record_holds_is_quarantined(honest_replicas, level):
    # The record forgot the positions a fresh witness would be fed from: a second replica fed alongside the mirror
    # from the start (a vote's second mirror) is the witness, so a lie there is proven as on a short prompt.
    refuted, _, chain, proved_wrong = await run_long_prompt(level, lie_from=BUDGET_POSITIONS + 8)
    assert refuted is not None and refuted.shard_id == LIAR.shard_id
    assert refuted.rewind_to == BUDGET_POSITIONS + 8
    assert refuted.kind == "refuted"
    assert proved_wrong == [LIAR.shard_id]
    assert chain.most_held <= BUDGET_BYTES


@pytest.mark.parametrize("level", ["sampled", "all"])
async def test_with_no_third_replica_a_lie_on_a_long_prompt_is_disputed_as_on_a_short_one(honest_replicas, level):
    del honest_replicas[1:]  # the mirror only: nobody to settle a mismatch, however long the prompt
    refuted, _, chain, proved_wrong = await run_long_prompt(level, lie_from=BUDGET_POSITIONS + 8)
    assert refuted is not None and refuted.kind == "disputed" and refuted.shard_id == LIAR.shard_id
    assert refuted.rewind_to == BUDGET_POSITIONS + 8
    assert proved_wrong == []
    assert chain.most_held <= BUDGET_BYTES


async def test_a_liar_from_the_first_position_of_a_long_prompt_is_quarantined(honest_replicas):
    refuted, _, _, proved_wrong = await run_long_prompt("all", lie_from=0)
    assert refuted is not None and refuted.kind == "refuted" and refuted.rewind_to == 0
    assert proved_wrong == [LIAR.shard_id]


@pytest.mark.parametrize("level", ["sampled", "all", "vote"])
async def test_an_honest_long_prompt_is_checked_whole_within_the_budget(honest_replicas, level):
    refuted, verifier, chain, _ = await run_long_prompt(level, lie_from=None)
    assert refuted is None
    assert not chain.recorder.broken
    (summary,) = verifier.summaries()
    host = next(shard for shard in summary.shards if shard.shard_id == LIAR.shard_id)
    # `sampled` checks the prompt's tail, still recorded, as any step: by its draw (here never).
    checked_at_least = LONG_PROMPT - BUDGET_POSITIONS if level == "sampled" else LONG_PROMPT
    assert LONG_PROMPT >= host.verified_positions >= checked_at_least
    assert chain.most_held <= BUDGET_BYTES


async def test_a_long_prompt_configured_to_go_in_one_step_goes_in_chunks_the_record_holds(honest_replicas):
    # One step longer than the record holds could never be recorded: its chunks are cut to half the budget.
    refuted, _, chain, _ = await run_long_prompt("all", lie_from=BUDGET_POSITIONS + 8, chunk_tokens=0)
    assert refuted is not None and refuted.shard_id == LIAR.shard_id and refuted.rewind_to == BUDGET_POSITIONS + 8
    assert chain.most_held <= BUDGET_BYTES


async def test_a_hop_no_replica_can_check_leaves_the_others_checked_past_the_budget(monkeypatch):
    # Hop 1's layers have no other replica: it is not checked, and what its record holds must not stop the record
    # from forgetting what hop 0's checks read (else the long prompt would leave hop 0 unchecked too).
    async def open_mirror(ctx, call, chain, index, avoid, chance):
        return StandInMirror(f"r{len(avoid)}") if index == 0 else None

    monkeypatch.setattr(mirrored_checks, "open_mirror", open_mirror)
    budget = BUDGET_POSITIONS * HIDDEN * 4 * 3  # hop 0's input, hop 1's, the chain's output
    verifier, _, _ = await verifier_of("all", prompt_tokens=LONG_PROMPT)
    recorder = ChainRecorder(None, "p", ["liar", "lone"], link_keys=[None, None], sealed=False, step_limits=None,
                             budget_bytes=budget)
    recorder._taps = [StandInTap()]
    await recorder.start("s")
    lone = Hop(shard_id="m:4-7@lone", control_subject="c", node_id="lone", layer_lo_to_run=4, layer_hi_to_run=7,
               quantization="none")
    chain = LongPromptLiar(recorder, None, hops=(LIAR, lone))
    await verifier.attach(chain)
    hidden = torch.randn(1, LONG_PROMPT, HIDDEN)
    output = await prefill(chain, hidden, verifier.prefill_chunk_tokens(CHUNK, hidden), make_room=verifier.make_room)
    assert not isinstance(output, StepFailure)
    verifier.after_step()
    assert await verifier.verify_step() is None
    assert not recorder.broken and chain.most_held <= budget
    (summary,) = verifier.summaries()
    assert {shard.shard_id: shard.verified_positions for shard in summary.shards}[LIAR.shard_id] == LONG_PROMPT


async def test_a_witness_is_fed_only_once_the_record_needs_room(honest_replicas):
    # A session that may outgrow the record costs a second replica only once it does: until then the record forgets
    # nothing, so the witness can still be fed from position 0 when it comes.
    verifier, recorder, _ = await verifier_of("all", budget_bytes=10 * STEP_BYTES)
    verifier.prefill_chunk_tokens(0, torch.zeros(1, 3, HIDDEN))  # a session of 64 positions may outgrow 10
    run_step(recorder, 1, FrameKind.prefill, 0, 3)
    assert await verifier.verify_step() is None
    assert len(honest_replicas) == 3, "one mirror while the record has room"
    number = 1
    while not recorder.filling:
        number += 1
        run_step(recorder, number, FrameKind.decode, number + 1, 1)
        assert await verifier.verify_step() is None
    assert len(honest_replicas) == 2, "the witness joined once the record needed room"
    for _ in range(12):  # well past the budget: the record forgets what both read, and nothing breaks
        number += 1
        run_step(recorder, number, FrameKind.decode, number + 1, 1)
        assert await verifier.verify_step() is None
    assert not recorder.broken and recorder.held_bytes <= 10 * STEP_BYTES
