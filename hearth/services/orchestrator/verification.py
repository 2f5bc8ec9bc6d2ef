"""CallVerifier: checks the work of one call's shard hosts on other replicas, and says when a step was refuted.

Each hop's inputs and outputs are recorded as the chain runs (hearth/services/orchestrator/recording.py). A check of hop
i feeds the inputs it ran since its last check to a mirror, a session of a second replica serving the same layers and
scheme (hearth/services/orchestrator/mirror.py), and compares the outputs position by position within the honest
tolerance of the looser dtype (hearth/inference/activation_compare.py; one check, and settling what it finds, is
mirrored_checks.py). When a check is made, by the call's `verify`:

| level     | which steps                                                                   | on the token's path |
|-----------|-------------------------------------------------------------------------------|---------------------|
| `none`    | none                                                                          | -                   |
| `sampled` | each hop with chance `sample_rate` per step; at a chain's first step while    | no (the last frame  |
|           | the range's guard has not learned; at once when an output leaves the guard    | waits for checks)   |
| `all`     | every step, every hop, one mirror each                                        | yes                 |
| `vote`    | every step, every hop, two mirrors each (three replicas, majority)            | yes                 |

A mismatch is settled by a third party: a witness replica fed the same inputs. The side the witness agrees with
is right and the other is quarantined (`integrity.mismatch_confirmed`, naming both agreeing parties); with no witness,
or one that agrees with neither, nobody is blamed (`integrity.mismatch_disputed`). Either way, when the call's own
hop is not the side confirmed, the step is refuted: the call withdraws the tokens sampled from that position on
and fails over around the hop. A replica that fails to answer is no evidence; it is dropped as a mirror.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

import torch

from hearth.events.models import IntegrityShardsVerified
from hearth.protocol.chat_frames import VerificationOutcome
from hearth.protocol.quarantine import Held
from hearth.services.common.lifecycle import log_failure
from hearth.services.orchestrator.chain import HopChain
from hearth.services.orchestrator.check_findings import CheckFindings
from hearth.services.orchestrator.check_policy import MIRRORS_PER_LEVEL, sampled_check_due
from hearth.services.orchestrator.guards import RangeKey
from hearth.services.orchestrator.hop_checks import HopChecks, checks_ran, end_checks, record_needed_from
from hearth.services.orchestrator.mirrored_checks import MirroredChecks
from hearth.services.orchestrator.outcomes import StepFailure, retold_failure
from hearth.services.orchestrator.recording import HopSpan

log = logging.getLogger(__name__)


class CallVerifier(MirroredChecks):
    """The checks of one call (PipelineRun owns it): `attach` each chain it opens, `after_step` after each step's
    output, `verify_step` (levels `all`, `vote`) before sampling from it, `settle` before the last frame, and
    `refuted` at every turn of the loop."""

    def __init__(self, call, ctx, record: Callable[[object], Awaitable[None]]) -> None:
        self.call, self.ctx = call, ctx
        self.found = CheckFindings(call, ctx, record)
        self.level = call.request.params.verify
        self.settings = ctx.settings.verification
        self.chain: HopChain | None = None
        self._hops: list[HopChecks] = []
        self._chain_steps = 0
        # The chain's record may forget positions: a witness is then fed from the start, once it needs room
        # (`_room_needed`: a long prompt's chunks crowd it; or decoded steps fill it).
        self._witness_due = self._room_needed = False
        self._proofs_before = len(ctx.proved_wrong)  # those shards were out of its routing from the start
        # Unpredictable to the hosts: a liar must not know which steps are checked.
        self._chance = random.SystemRandom()

    @property
    def records(self) -> bool:
        """Whether the call's chains record their hops' work."""
        return self.level != "none"

    @property
    def mirrors_per_hop(self) -> int:
        return MIRRORS_PER_LEVEL[self.level]

    # ------------------------------------------------------------------ the call's side

    async def attach(self, chain: HopChain) -> None:
        """Check `chain` from now on (the checks of an earlier chain end: it is closed)."""
        await self.detach()
        if chain.recorder is None:
            return
        self.chain = chain
        self._hops = [HopChecks() for _ in chain.hops]
        self._chain_steps, self._witness_due, self._room_needed = 0, False, False

    async def detach(self) -> None:
        """Stop checking the current chain: cancel its checks, close its mirrors."""
        hops, self._hops, self.chain = self._hops, [], None
        await end_checks(hops)

    async def check_report(self, accused: str) -> None:
        """A hop reported that its input, the output of `accused`, failed a check: check `accused` on everything up
        to the step that stopped, from the tap's copy of that output (so the report, unverifiable in itself, is
        settled on evidence: a confirmed mismatch quarantines the accused; a confirmed output clears it)."""
        chain = self.chain
        if chain is None or not chain.recorder.steps:
            return
        index = next((i for i, hop in enumerate(chain.hops) if hop.shard_id == accused), None)
        if index is None:
            return
        try:
            # The reporting hop had the output already, so the tap has it too (or refused it): no long wait. A check
            # running on the hop is waited for (as a last frame waits for the checks), then this one takes its turn.
            await self._check_hop(chain, index, upto=max(chain.recorder.steps),
                                  settle_s=self.ctx.settings.transport.probe_timeout_s,
                                  turn_within_s=self.settings.settle_timeout_s)
        except TimeoutError:
            log.warning("pipeline %s: the check running on the hop accused by a report did not end within %.0f s; "
                        "the report is left unchecked", self.call.pipeline_id, self.settings.settle_timeout_s)
        except Exception as error:  # a check must never take the call down with it; its message may quote activations
            log_failure(log, f"pipeline {self.call.pipeline_id}: checking the hop accused by a report", error)

    async def keep_alive(self) -> None:
        """Tell the mirrors' replicas that their sessions live, as a call's hops are told."""
        for hop in self._hops:
            for mirror in hop.mirrors:
                await mirror.chain.keep_alive()

    def refutation_of(self, shard_id: str) -> StepFailure | None:
        """The pending refutation of `shard_id` (then forgotten): the call is routing around it already."""
        return self.found.take_of(shard_id)

    def refuted(self) -> StepFailure | None:
        """The refutation a check found since the last turn (then forgotten), or None. A hop that another call's
        check (or a canary) proved wrong meanwhile is refuted from the first position this call did not confirm."""
        if self.found.refutation is None and self.chain is not None:
            held = Held.of(self.ctx.proved_wrong[self._proofs_before:])
            for index, hop in enumerate(self.chain.hops):
                if held.holds(hop.shard_id, hop.node_id):
                    self.found.refute("refuted", hop.shard_id, self._hops[index].confirmed_pos,
                                      "quarantined meanwhile (another check proved it, or its node, wrong); its "
                                      "unconfirmed work here is withdrawn")
                    break
        retold = self.chain.recorder.take_retold() if self.found.refutation is None and self.chain is not None else None
        if retold is not None:  # its successor computed what no replica would: unchecked, so withdrawn
            self.found.refutation = retold_failure(self.chain.hops[retold[0] - 1].shard_id, *retold)
        return self.found.take()

    def after_step(self) -> None:
        """A step's output came: start the checks this step calls for (level `sampled`)."""
        if self.chain is None or self.level != "sampled":
            return
        self._chain_steps += 1
        recorder = self.chain.recorder
        latest = recorder.latest_step()
        recorded = recorder.steps.get(latest) if latest is not None else None
        for index in range(len(self.chain.hops)):
            key = self._range_key(index)
            output = recorded.hop_output(index) if recorded is not None else None
            why = sampled_check_due(first_step=self._chain_steps == 1, learned=self.ctx.guards.learned(key),
                                    suspect=output is not None and self.ctx.guards.suspect(key, output),
                                    draw=self._chance.random(), sample_rate=self.settings.sample_rate,
                                    record_filling=recorder.filling)
            if why is not None:
                self._start_check(index, why)

    def prefill_chunk_tokens(self, configured: int, hidden: torch.Tensor) -> int:
        """The chunks the prompt `hidden` goes out in: `configured` (0: one step), fewer positions where a chunk
        would take more than half the chain's record (one that never fits would leave the chain unchecked). Where
        the record may have to forget positions, every hop's checks feed a witness beside its mirrors (`_mirrors`)."""
        if self.chain is None:
            return configured
        call, recorder = self.call, self.chain.recorder
        start = len(call.known_ids) - int(hidden.shape[1])  # the positions its hops hold already (a kept prefix)
        later = max(0, (self.chain.max_session_tokens or 0) - len(call.known_ids))
        self._witness_due = recorder.may_forget(hidden, max(0, len(call.prompt_ids) - start), later)
        self._room_needed = False
        return recorder.chunk_within(configured, hidden)

    async def make_room(self, chunk: torch.Tensor, others_out: bool) -> bool | StepFailure:
        """Before a prompt's `chunk` goes out (prefill.py's MakeRoom), at every level that checks: once the record
        would hold more than half its budget, every hop is checked on what it ran so far, so that the record forgets
        it; when the chunk would not fit, those checks are waited for (then the output of a chunk out, `others_out`:
        False). A prompt longer than the record holds is thus checked as it streams, not left unchecked (a host sees
        its length); the refutation a check found ends the prefill."""
        if self.chain is None:
            return True
        recorder = self.chain.recorder
        if recorder.crowded(chunk):
            self._room_needed = True
            for index in range(len(self.chain.hops)):
                self._start_check(index, "prompt streaming")
            if not recorder.fits(chunk):
                await self._checks_ran()
        if self.found.refutation is not None:
            return self.refuted()
        return recorder.fits(chunk) or not others_out

    async def verify_step(self) -> StepFailure | None:
        """Levels `all` and `vote`: check every hop up to the step just done, now; the refutation, if any."""
        if self.chain is None or self.level not in ("all", "vote"):
            return None
        await self._checks_ran(cancel=True)  # a hop's mirror runs one check at a time
        await asyncio.gather(*(self._check(index) for index in range(len(self.chain.hops))))
        return self.refuted()

    async def _checks_ran(self, *, cancel: bool = False) -> None:
        await checks_ran(self._hops, self.settings.settle_timeout_s, self.call.pipeline_id, cancel=cancel)

    async def settle(self) -> StepFailure | None:
        """Before the call's last frame: wait for the checks still running (at most `settle_timeout_s`); `all` and
        `vote` check again what a failed check left unchecked, as no next step will (caught-up hops cost nothing)."""
        if self.level in ("all", "vote"):
            refuted = await self.verify_step()
        else:
            await self._checks_ran()
            refuted = self.refuted()
        if refuted is None and self.chain is not None:
            # What the answer rests on: at `all` and `vote` every position checked, at `sampled` no check left over.
            steps = self.chain.recorder.steps.values()
            end = max((step.pos + step.tokens for step in steps if step.output is not None), default=0)
            for hop, checks in zip(self.chain.hops, self._hops):
                if checks.running or (self.level != "sampled" and checks.confirmed_pos < end):
                    self.found.fell_short(hop.shard_id, "its last work was left unchecked")
        return refuted

    def outcome(self) -> VerificationOutcome | None:
        """Whether the call's hops were checked as its level asks (its last frame's `verification`): `unmet` when
        some hop's were not (CheckFindings.fell_short); None at level `none`."""
        if self.level == "none":
            return None
        return "unmet" if self.found.unmet else "met"

    def summaries(self) -> list[IntegrityShardsVerified]:
        """The call's checks that found nothing wrong (CheckFindings.summaries)."""
        return self.found.summaries(self.ctx.node_id)

    def _start_check(self, index: int, why: str) -> None:
        hop = self._hops[index]
        if hop.running:
            hop.again = True
            return
        log.debug("pipeline %s: checking hop %d (%s)", self.call.pipeline_id, index, why)
        hop.task = asyncio.create_task(self._check_until_caught_up(index),
                                       name=f"check-{self.call.pipeline_id}-{index}")

    async def _check_until_caught_up(self, index: int) -> None:
        hop = self._hops[index]
        while True:
            hop.again = False
            await self._check(index)
            if not hop.again or self.found.refutation is not None:
                return

    async def _check(self, index: int) -> None:
        """Check hop `index` on everything it ran since its last check; a refutation is kept for the call."""
        chain = self.chain
        try:
            await self._check_hop(chain, index)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # a check must never take the call down with it; its message may quote activations
            log_failure(log, f"pipeline {self.call.pipeline_id}: checking hop {index}", error)

    async def _check_hop(self, chain: HopChain, index: int, upto: int | None = None, settle_s: float | None = None,
                         turn_within_s: float | None = None) -> None:
        async with self._hops[index].turn(turn_within_s):
            await self._check_mirrored(chain, index, upto, settle_s)

    # ------------------------------------------------------------------ outcomes

    def _confirm(self, shard_id: str, span: HopSpan, index: int | None) -> None:
        self.found.confirmed(shard_id, span.positions)
        if index is not None:
            self.ctx.guards.learn(self._range_key(index), span.outputs)
            self._hops[index].confirmed_pos = max(self._hops[index].confirmed_pos, span.end_pos)
            recorder = self.chain.recorder
            recorder.needed_from = record_needed_from(self._hops, recorder.broken, self._witness_due,
                                                      recorder.generation)

    def _range_key(self, index: int) -> RangeKey:
        hop = self.chain.hops[index]
        return (self.call.model.model_id, hop.layer_lo_to_run, hop.layer_hi_to_run, hop.quantization)
