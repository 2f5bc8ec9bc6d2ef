"""ChainRecorder: what every hop of one chain received and sent, step by step, so that each hop's work can be run
again on another replica and compared (hearth/services/orchestrator/verification.py).

Hop 0's input is what the orchestrator sent, the last hop's output is what reached its sink; what passed between
two hops is read off their link by a tap: a second subscriber to the link's subject that opens the frames with the
link key (the orchestrator made every link key) and never acks. One publish reaches the next hop and the tap
alike, so a hop cannot show the tap one thing and its successor another. Nothing recorded leaves the process or is
persisted; it outlives the chain only as kept inputs (hearth/services/orchestrator/kept_inputs.py), in memory.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from nats.aio.client import Client as NatsClient

from hearth.protocol.subjects import LinkNodes
from hearth.services.common.config import TransportSettings
from hearth.services.transport import (ActivationReceiver, FrameKind, StepInfo, StepLimits, TransportError,
                                       receiver_settings)

log = logging.getLogger(__name__)

# Steps a tap holds for the recorder; far more than a chain has out at once, so a tap never drops one.
tap_ready_steps = 4096


@dataclass
class RecordedStep:
    """One step of the chain: where it starts, and per hop its input (index 0: what the orchestrator sent)."""

    step: int
    kind: FrameKind
    pos: int
    tokens: int
    inputs: list[torch.Tensor | None]
    # What left the last hop (set once the sink returned it).
    output: torch.Tensor | None = None
    # The prompt's length a prefill step was sent with (Hearth-Prompt-Tokens).
    prompt_tokens: int | None = None
    # When it went out (monotonic s): a canary of it keeps the call's cadence.
    sent_at: float = 0.0
    # What the record holds of it, all hops' inputs and the output counted.
    nbytes: int = 0

    def hop_output(self, hop: int) -> torch.Tensor | None:
        """What hop `hop` sent on: the next hop's input, or the chain's output for the last hop."""
        return self.inputs[hop + 1] if hop + 1 < len(self.inputs) else self.output


@dataclass(frozen=True)
class HopSpan:
    """A run of consecutive positions of one hop: its inputs and outputs concatenated along positions."""

    hop: int
    first_pos: int
    inputs: torch.Tensor
    outputs: torch.Tensor
    # The kind of step that computed each position on the hop (for the evidence).
    kinds: tuple[FrameKind, ...] = field(default=())
    last_step: int = 0
    # The prompt's length its prefill positions were sent with, if it holds any.
    prompt_tokens: int | None = None
    # When the step that computed each position went out (monotonic s).
    sent_at: tuple[float, ...] = field(default=())

    @property
    def positions(self) -> int:
        return int(self.inputs.shape[1])

    @property
    def end_pos(self) -> int:
        return self.first_pos + self.positions

    def tail_of(self, output: torch.Tensor) -> torch.Tensor:
        """A mirror's outputs over this span: the last `positions` it ran (it may have run more)."""
        return output[:, output.shape[1] - self.positions:]


class ChainRecorder:
    """Records one chain's steps; `generation` moves on whenever the chain starts again from position 0 (a re-prefill
    after an eviction), which makes every earlier span void."""

    def __init__(self, nc: NatsClient, pipeline_id: str, node_ids: list[str], *, link_keys: list[bytes | None],
                 sealed: bool, step_limits: StepLimits | None, transport: TransportSettings | None = None,
                 budget_bytes: int | None = None) -> None:
        self.nc = nc
        self.pipeline_id = pipeline_id
        self.hop_count = len(node_ids)
        self.generation = 0
        self.steps: dict[int, RecordedStep] = {}
        # Per tapped hop, the recorded steps whose input its tap has not filed yet (what `settled` waits for).
        self._unfiled: dict[int, set[int]] = {hop: set() for hop in range(1, self.hop_count)}
        # Hops whose input a tap missed: their record has a hole, so they cannot be checked on this chain any more.
        self.broken: set[int] = set()
        # Hop -> the position of the first step the hop before passed on to it told otherwise than it was sent.
        self._retold: dict[int, int] = {}
        # The host's `[transport]` bounds, but for the steps held: a tap never drops one for want of room.
        bounds = {**receiver_settings(transport or TransportSettings()), "max_ready_steps": tap_ready_steps}
        self._taps = [ActivationReceiver(nc, pipeline_id, hop,
                                         nodes=LinkNodes(sender=node_ids[hop - 1], receiver=node_ids[hop]),
                                         link_key=link_keys[hop], seal=sealed and link_keys[hop] is not None,
                                         step_limits=step_limits, acks=False, on_refused=self._refused_on(hop),
                                         **bounds)
                      for hop in range(1, self.hop_count)]
        self._session: str | None = None
        # What the record may hold: past half of what the prompt's steps leave of it, the decoded steps every hop's
        # checks consumed are forgotten (and the checks are made, `filling`; the prompt's are kept, for the kept
        # inputs of a next turn, unless a long prompt's own chunks need their room: its checks run as it streams,
        # `crowded`); what still finds no room is not recorded, and no hop can be checked any more.
        self.budget_bytes = budget_bytes
        self.held_bytes = self._prompt_bytes = 0
        # The position every hop's mirrors were fed to (the verifier moves it): no check reads before it again.
        self.needed_from = 0
        # The end of the last position this run forgot (0: none): a replica fed less cannot be fed on from here.
        self.forgot_to = 0
        self._latest: int | None = None

    async def start(self, session_id: str) -> None:
        self._session = session_id
        for tap in self._taps:
            await tap.start()

    async def close(self) -> None:
        for tap in self._taps:
            try:
                await tap.close()
            except Exception:  # closing a chain must not fail on a tap
                log.debug("closing a tap of %s failed", self.pipeline_id, exc_info=True)
        self._forget_steps()

    def sent(self, info: StepInfo, hidden: torch.Tensor) -> None:
        """Hop 0's input of step `info.step` went out."""
        if info.pos == 0 and info.kind is FrameKind.prefill:
            # Everything before belongs to an earlier run of the chain's positions.
            self._forget_steps()
            self.broken.clear()
            self._retold.clear()
            self.generation += 1
            self.held_bytes, self._prompt_bytes, self._latest, self.needed_from, self.forgot_to = 0, 0, None, 0, 0
        step_bytes = self._bytes_of(hidden)
        if not self._room_for(step_bytes):
            if len(self.broken) < self.hop_count:
                log.info("pipeline %s: its record reached its budget (%d MiB); no more checks on this chain",
                         self.pipeline_id, self.budget_bytes >> 20)
            self.broken.update(range(self.hop_count))
            return
        self.held_bytes += step_bytes
        if info.kind is FrameKind.prefill:
            self._prompt_bytes += step_bytes
        self.steps[info.step] = RecordedStep(info.step, info.kind, info.pos, int(hidden.shape[1]),
                                             [hidden.detach()] + [None] * (self.hop_count - 1),
                                             prompt_tokens=info.prompt_tokens, sent_at=time.monotonic(),
                                             nbytes=step_bytes)
        for unfiled in self._unfiled.values():
            unfiled.add(info.step)

    def completed(self, info: StepInfo, output: torch.Tensor) -> RecordedStep | None:
        """The chain's output of step `info.step` arrived; what the taps hold so far is filed with it."""
        recorded = self.steps.get(info.step)
        if recorded is not None:
            recorded.output = output.detach()
            self._latest = max(self._latest or 0, info.step)
        self._file_tapped()
        return recorded

    def fits(self, hidden: torch.Tensor) -> bool:
        """Whether a step sending `hidden` into hop 0 would be recorded, once what every hop's checks read is
        forgotten (the prompt's steps too, when nothing else makes room)."""
        return self._room_for(self._bytes_of(hidden))

    def chunk_within(self, chunk_tokens: int, hidden: torch.Tensor) -> int:
        """The positions of `hidden` a prefill step may carry: `chunk_tokens` (0: all in one step), at most what
        takes half the budget, so that a chunk always finds room once the checks made it (CallVerifier.make_room)."""
        if self.budget_bytes is None:
            return chunk_tokens
        fitting = max(1, self.budget_bytes // 2 // self._bytes_of(hidden[:, :1]))
        return min(chunk_tokens or fitting, fitting)

    def may_forget(self, hidden: torch.Tensor, prompt_positions: int, later_positions: int) -> bool:
        """Whether a chain whose first step sends `hidden` (its first `prompt_positions` the prompt's, the rest
        replayed tokens), then up to `later_positions` decoded ones, may have to forget positions: past half of what
        the prompt leaves (the decoded ones), or past the budget (the prompt's)."""
        if self.budget_bytes is None:
            return False
        decoded = int(hidden.shape[1]) - prompt_positions + later_positions
        return (prompt_positions + 2 * decoded) * self._bytes_of(hidden[:, :1]) > self.budget_bytes

    def crowded(self, hidden: torch.Tensor) -> bool:
        """Whether, with a step sending `hidden`, the record would hold more than half its budget: checks of the
        prompt are due as it streams, so that the record can forget what they read before it runs out of room."""
        return self.budget_bytes is not None and (self.held_bytes + self._bytes_of(hidden)) * 2 > self.budget_bytes

    @property
    def filling(self) -> bool:
        """Whether decoded steps fill more than half what the prompt's leave of the budget: checks are due, so that
        the record can forget what they read."""
        return self._past_half(0)

    def _past_half(self, more_bytes: int) -> bool:
        return (self.budget_bytes is not None
                and (self.held_bytes - self._prompt_bytes + more_bytes) * 2 > self.budget_bytes - self._prompt_bytes)

    def take_retold(self) -> tuple[int, int] | None:
        """(hop, position) of the first hop the hop before passed a step on to told otherwise (kind, position or
        prompt length) than it was sent, from that step's position; each said once, None when there is none."""
        if not self._retold:
            return None
        hop = min(self._retold)
        return hop, self._retold.pop(hop)

    def latest_step(self) -> int | None:
        """The newest step whose output arrived."""
        return self._latest

    async def settled(self, upto_step: int, timeout_s: float, hops: set[int] | None = None) -> None:
        """Wait (at most `timeout_s`) until the taps filed the inputs of `hops` (None: every hop) for every step up to
        `upto_step`; a hop whose input did not come is marked broken."""
        deadline = time.monotonic() + timeout_s
        for index, tap in enumerate(self._taps, start=1):
            if hops is not None and index not in hops:
                continue
            while index not in self.broken and self._missing(index, upto_step):
                remaining_s = deadline - time.monotonic()
                try:
                    if remaining_s <= 0:
                        raise TransportError("tap timed out")
                    received = await tap.next_step(timeout_s=remaining_s)
                except TransportError:
                    log.info("pipeline %s: the tap of hop %d missed a step; that hop is not checked on this chain",
                             self.pipeline_id, index)
                    self.broken.add(index)
                    break
                self._file(index, received)

    def span(self, hop: int, from_pos: int, upto_step: int) -> HopSpan | None:
        """Hop `hop`'s inputs and outputs from position `from_pos` through step `upto_step` (None when there is
        nothing new, or the record has a hole)."""
        steps = sorted((s for s in self.steps.values() if s.step <= upto_step and s.pos + s.tokens > from_pos),
                       key=lambda s: s.pos)
        inputs, outputs, kinds, sent_at = [], [], [], []
        expected_pos = from_pos
        for recorded in steps:
            hop_input, hop_output = recorded.inputs[hop], recorded.hop_output(hop)
            if hop_input is None or hop_output is None or recorded.pos > expected_pos:
                return None
            skip = expected_pos - recorded.pos
            inputs.append(hop_input[:, skip:])
            outputs.append(hop_output[:, skip:])
            kinds += [recorded.kind] * (recorded.tokens - skip)
            sent_at += [recorded.sent_at] * (recorded.tokens - skip)
            expected_pos = recorded.pos + recorded.tokens
        if not inputs:
            return None
        return HopSpan(hop, from_pos, torch.cat(inputs, dim=1), torch.cat(outputs, dim=1), tuple(kinds),
                       last_step=max(s.step for s in steps),
                       prompt_tokens=max((s.prompt_tokens for s in steps if s.prompt_tokens), default=None),
                       sent_at=tuple(sent_at))

    def resized_by(self, step: int, tokens: int) -> int | None:
        """The hop that passed `step` (sent with `tokens` positions) on with other positions, as the taps saw it (a hop
        cannot show its next hop and a tap different frames): the hop before the first link whose copy differs, the
        last hop when every link's copy has `tokens`; None when a tap has no copy of it."""
        self._file_tapped()
        recorded = self.steps.get(step)
        if recorded is None:
            return None
        for hop in range(1, self.hop_count):
            tapped = recorded.inputs[hop]
            if tapped is None:
                return None
            if tapped.shape[1] != tokens:
                return hop - 1
        return self.hop_count - 1

    def _refused_on(self, hop: int):
        async def refused(header, refusal) -> None:
            # A frame that does not fit the pipeline never completes: nothing to wait for on this link.
            if header.session == self._session:
                self.broken.add(hop)
        return refused

    def _missing(self, hop: int, upto_step: int) -> bool:
        return any(step <= upto_step for step in self._unfiled[hop])

    def _bytes_of(self, hidden: torch.Tensor) -> int:
        """What the record holds of a step sending `hidden`: every hop's input and the chain's output."""
        return hidden.numel() * hidden.element_size() * (self.hop_count + 1)

    def _room_for(self, step_bytes: int) -> bool:
        """Forget what the checks read as the budget calls for; whether `step_bytes` more then fit. Past half of
        what the prompt leaves, the decoded steps; when even so it would not fit (a prompt longer than the budget
        holds), the prompt's steps too: a next turn's kept inputs are lost then, not the checks of this one."""
        if self._past_half(step_bytes):
            self._forget_before(self.needed_from)
        if self.budget_bytes is None or self.held_bytes + step_bytes <= self.budget_bytes:
            return True
        self._forget_before(self.needed_from, prompt_too=True)
        return self.held_bytes + step_bytes <= self.budget_bytes

    def _forget_before(self, position: int, *, prompt_too: bool = False) -> None:
        """Forget the decoded steps (and prefill steps, `prompt_too`) before `position` that every tap filed (a check
        can no longer begin before it); a prefill step only when there is no other room (what entered each hop over
        the prompt is kept when the call ends: kept_inputs.py)."""
        for number, recorded in list(self.steps.items()):
            if (recorded.pos + recorded.tokens <= position
                    and (prompt_too or recorded.kind is not FrameKind.prefill)
                    and recorded.output is not None
                    and all(hop_input is not None for hop_input in recorded.inputs)):
                del self.steps[number]
                self.held_bytes -= recorded.nbytes
                self.forgot_to = max(self.forgot_to, recorded.pos + recorded.tokens)
                if recorded.kind is FrameKind.prefill:
                    self._prompt_bytes -= recorded.nbytes

    def _forget_steps(self) -> None:
        self.steps.clear()
        for unfiled in self._unfiled.values():
            unfiled.clear()

    def _file_tapped(self) -> None:
        for index, tap in enumerate(self._taps, start=1):
            for received in tap.take_ready():
                self._file(index, received)

    def _file(self, hop: int, received) -> None:
        if received.session != self._session:
            return
        recorded = self.steps.get(received.step)
        if recorded is not None and received.tensor is not None:
            told = received.info
            if (told.kind, told.pos, told.prompt_tokens) != (recorded.kind, recorded.pos, recorded.prompt_tokens):
                # Hops pass a step's header on as they got it: hop - 1 told its successor another step than ours,
                # so what hop `hop` computed cannot be checked against what we would have a replica compute.
                if hop not in self.broken:
                    log.warning("pipeline %s: hop %d passed step %d on as %s at %d (prompt %s), not as it was sent "
                                "(%s at %d, prompt %s); hop %d is not checked on this chain", self.pipeline_id,
                                hop - 1, received.step, told.kind.value, told.pos, told.prompt_tokens,
                                recorded.kind.value, recorded.pos, recorded.prompt_tokens, hop)
                self.broken.add(hop)
                self._retold.setdefault(hop, recorded.pos)
            recorded.inputs[hop] = received.tensor
            self._unfiled[hop].discard(received.step)

