"""MirroredChecks, mixed into CallVerifier: one check of one hop on its mirrors: feeding them what the hop ran since
they stopped, comparing their outputs with the hop's position by position within the honest tolerance, and settling a
mismatch by a witness (the hop or the mirror quarantined and the step refuted, or a dispute that blames nobody)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import torch

from hearth.inference.activation_compare import (evidence_digest, first_mismatch, position_errors, reportable_error,
                                          tolerance_for)
from hearth.services.orchestrator.canaries import confirmed_canary
from hearth.services.orchestrator.chain import HopChain
from hearth.services.orchestrator.metrics import verification_checks_total
from hearth.services.orchestrator.mirror import Mirror, open_mirror
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.orchestrator.recording import HopSpan

# The verifier's own logger: what a check logs goes out under the name it always did.
log = logging.getLogger("hearth.services.orchestrator.verification")


class MirroredChecks:
    """Mixed into CallVerifier: reads its call, context, level, per-hop checks (`_hops`), findings (`found`), random
    source and witness flags, and its `_confirm` and `_range_key`."""

    async def _check_mirrored(self, chain: HopChain, index: int, upto: int | None, settle_s: float | None) -> None:
        recorder, hop = chain.recorder, self._hops[index]
        latest = upto if upto is not None else recorder.latest_step()
        if latest is None:
            return
        await recorder.settled(latest, settle_s or self.ctx.settings.transport.step_timeout_s, hops={index, index + 1})
        if index in recorder.broken:
            self.found.fell_short(chain.hops[index].shard_id, "its record has a hole (a tap missed a step, a step was "
                                                               "retold, or the record had no room)")
            return
        mirrors = await self._mirrors(chain, index)
        if len(mirrors) < self.mirrors_per_hop:
            self._mirrored_short(chain, index, len(mirrors))
        if not mirrors:
            return
        spans = [recorder.span(index, mirror.fed_pos, latest) for mirror in mirrors]
        if any(span is None for span in spans):
            return
        # A vote's two mirrors run at once: the check takes the time of the slower, not of both.
        outputs = await asyncio.gather(*(mirror.check(span) for mirror, span in zip(mirrors, spans)))
        for mirror, output in zip(mirrors, outputs):
            if isinstance(output, StepFailure):
                log.info("pipeline %s: mirror %s of hop %d failed (%s); dropped", self.call.pipeline_id,
                         mirror.shard_id, index, output)
                await hop.drop(mirror)
        if any(isinstance(output, StepFailure) for output in outputs):
            return
        runs = list(zip(mirrors, spans, outputs))
        # Mirrors of one hop are fed alike, so their spans match; judge on the shortest common one.
        span = min((run[1] for run in runs), key=lambda s: s.positions)
        claimed = span.outputs
        # Each mirror by its dtype's tolerance (the looser of its and the hop's), a witness by the looser of its and
        # the mirror's: an honest replica of a looser dtype is never judged by a tighter bound.
        def tolerance(dtype: str) -> float:
            return tolerance_for(None, dtype, chain.hops[index].quantization, chain.wire_dtype)

        outcomes = [(mirror, span.tail_of(output), first_mismatch(position_errors(claimed, span.tail_of(output)),
                                                                  tolerance(mirror.dtype)))
                    for mirror, _, output in runs]
        if all(bad is None for _, _, bad in outcomes):
            self._confirm(chain.hops[index].shard_id, span, index)
            for mirror, _, _ in outcomes:
                self._confirm(mirror.shard_id, span, None)
            if span.first_pos == 0:
                self.ctx.canaries.keep(confirmed_canary(self._range_key(index), self.call.model.weights_sha256,
                                                        chain, index, span, mirrors))
            return
        mirror, reference, _ = next(outcome for outcome in outcomes if outcome[2] is not None)
        await self._settle_mismatch(chain, index, span, mirror, reference, tolerance, outcomes)

    async def _settle_mismatch(self, chain: HopChain, index: int, span: HopSpan, mirror: Mirror,
                               reference: torch.Tensor, tolerance_of: Callable[[str], float], outcomes) -> None:
        """The hop and `mirror` disagree on `span`: ask a witness (the second mirror, in a vote), judge, record."""
        primary = chain.hops[index].shard_id
        hop = self._hops[index]
        others = [(m, output) for m, output, _ in outcomes if m is not mirror]
        if not others:
            witness = await self._witness(chain, index, span, avoid={primary, mirror.shard_id} | hop.avoid)
            others = [witness] if witness is not None else []
        errors = position_errors(span.outputs, reference)
        tolerance = tolerance_of(mirror.dtype)
        bad = first_mismatch(errors, tolerance)
        evidence = dict(layer_lo=chain.hops[index].layer_lo_to_run, layer_hi=chain.hops[index].layer_hi_to_run,
                        quantization=chain.hops[index].quantization, dtype=mirror.dtype,
                        position=span.first_pos + bad, step_kind=span.kinds[bad].value,
                        relative_error=reportable_error(errors[bad]), tolerance=tolerance,
                        evidence_sha256=evidence_digest(span.inputs, span.outputs, reference), node_id=self.ctx.node_id,
                        pipeline_id=self.call.pipeline_id)
        for witness, witnessed in others:
            judged = max(tolerance, tolerance_of(witness.dtype))
            sides_with_mirror = first_mismatch(position_errors(witnessed, reference), judged) is None
            sides_with_hop = first_mismatch(position_errors(witnessed, span.outputs), judged) is None
            if sides_with_mirror and not sides_with_hop:
                await self.found.quarantine(primary, [mirror.shard_id, witness.shard_id], evidence)
                if witness not in hop.mirrors:  # the call leaves this chain: a fresh witness has no more to do
                    await witness.close()
                self.found.refute("refuted", primary, span.first_pos + bad,
                                  f"its output at position {span.first_pos + bad} was refuted by {mirror.shard_id} "
                                  f"and {witness.shard_id} (relative error {float(errors[bad]):.3g} > "
                                  f"{tolerance:g}); quarantined")
                return
            if sides_with_hop and not sides_with_mirror:
                await self.found.quarantine(mirror.shard_id, [primary, witness.shard_id], evidence)
                await hop.drop(mirror)
                if witness not in hop.mirrors:  # a fresh witness takes the dropped mirror's place
                    hop.mirrors.append(witness)
                self._confirm(primary, span, index)
                return
        await self.found.dispute([primary, mirror.shard_id], evidence)
        await hop.drop(mirror)
        for witness, _ in others:
            if witness not in hop.mirrors:
                await witness.close()
        self.found.refute("disputed", primary, span.first_pos + bad,
                          f"its output at position {span.first_pos + bad} differs from {mirror.shard_id}'s (relative "
                          f"error {float(errors[bad]):.3g} > {tolerance:g}) and no third replica settled it: routed "
                          f"around for this call, nobody blamed")

    async def _witness(self, chain: HopChain, index: int, span: HopSpan, avoid: set[str]):
        """A third replica fed the hop's inputs from position 0 through `span`: (mirror, its outputs over `span`)."""
        if chain.recorder.forgot_to > 0:  # the record no longer holds what a fresh replica would be fed first
            return None
        witness = await self._open_mirror(chain, index, avoid)
        return await witness.witness(chain.recorder, index, span) if witness is not None else None

    # ------------------------------------------------------------------ mirrors

    async def _mirrors(self, chain: HopChain, index: int) -> list[Mirror]:
        """The hop's mirrors (opened as needed): the replicas that check it, fed from where they stopped."""
        recorder = chain.recorder
        return await self._hops[index].mirrors_of_run(
            recorder, self.mirrors_per_hop, self._witness_due and (self._room_needed or recorder.filling),
            lambda avoid: self._open_mirror(chain, index, avoid | {chain.hops[index].shard_id}))

    def _mirrored_short(self, chain: HopChain, index: int, mirrors: int) -> None:
        """Hop `index` has `mirrors` mirrors, fewer than its level asks: checked by those alone, the level unmet."""
        forgot_to = chain.recorder.forgot_to
        verification_checks_total.labels("history_forgotten" if forgot_to else "no_replica").inc()
        why = (f"its record forgot the positions before {forgot_to}, so no fresh replica could be fed them in a lost "
               f"mirror's place" if forgot_to else f"fewer other replicas than {self.level} asks")
        self.found.fell_short(chain.hops[index].shard_id,
                              f"{why}; checked by {mirrors} mirror{'s' if mirrors > 1 else ''}" if mirrors else why)

    async def _open_mirror(self, chain: HopChain, index: int, avoid: set[str]) -> Mirror | None:
        return await open_mirror(self.ctx, self.call, chain, index, avoid | self.call.excluded.keys(), self._chance)
