"""CheckFindings: what one call's checks found (hearth/services/orchestrator/verification.py makes them): the
confirmations tallied per shard (the call's `integrity.shards_verified`), the quarantines and disputes recorded, and
the refutation of the call's own work, kept until the call takes it."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from hearth.events.models import (IntegrityMismatchConfirmed, IntegrityMismatchDisputed, IntegrityShardsVerified,
                                  ShardVerification, max_verified_shards)
from hearth.services.orchestrator.metrics import verification_checks_total
from hearth.services.orchestrator.outcomes import StepFailure

log = logging.getLogger(__name__)


@dataclass
class _Tally:
    checks: int = 0
    verified_positions: int = 0


class CheckFindings:
    """The findings of one call's checks; events go through `record`, the call's own way of recording one."""

    def __init__(self, call, ctx, record: Callable[[object], Awaitable[None]]) -> None:
        self.call, self.ctx = call, ctx
        self._record = record
        self._tally: dict[str, _Tally] = {}
        # The earliest refutation of the call's work not yet taken by the call.
        self.refutation: StepFailure | None = None
        # The shards whose work in the call was not checked as its level asks, with why (its level was `unmet`).
        self.unmet: dict[str, str] = {}

    def confirmed(self, shard_id: str, positions: int) -> None:
        """A check found `positions` of `shard_id`'s work right."""
        tally = self._tally.setdefault(shard_id, _Tally())
        tally.checks += 1
        tally.verified_positions += positions
        verification_checks_total.labels("confirmed").inc()

    def fell_short(self, shard_id: str, why: str) -> None:
        """`shard_id`'s work in this call was not checked as the call's `verify` level asks, for `why`."""
        if shard_id not in self.unmet:
            log.info("pipeline %s: %s not checked as verify=%s asks: %s", self.call.pipeline_id, shard_id,
                     self.call.request.params.verify, why)
            self.unmet[shard_id] = why

    async def quarantine(self, shard_id: str, witnesses: list[str], evidence: dict) -> None:
        """`shard_id` was proved wrong by `witnesses`: kept out of this orchestrator's routing at once, recorded."""
        log.warning("pipeline %s: %s computed layers %d-%d wrongly (witnesses %s); quarantined",
                    self.call.pipeline_id, shard_id, evidence["layer_lo"], evidence["layer_hi"],
                    ", ".join(witnesses))
        self.ctx.prove_wrong(shard_id)
        verification_checks_total.labels("mismatch").inc()
        await self._record(IntegrityMismatchConfirmed(shard_id=shard_id, witnesses=witnesses, **evidence))

    async def dispute(self, shard_ids: list[str], evidence: dict) -> None:
        """Two replicas disagreed and nothing settled it: recorded, nobody blamed."""
        await self._record(IntegrityMismatchDisputed(shard_ids=shard_ids, **evidence))
        verification_checks_total.labels("disputed").inc()

    def refute(self, kind: str, shard_id: str, position: int, reason: str) -> None:
        """The call's work from `position` on, by `shard_id`, is not to be kept (the earliest refutation wins)."""
        if self.refutation is None or position < (self.refutation.rewind_to or 0):
            self.refutation = StepFailure(kind, shard_id, reason, check="mismatch", rewind_to=position)

    def take(self) -> StepFailure | None:
        """The refutation found since the last take (then forgotten), or None."""
        failure, self.refutation = self.refutation, None
        return failure

    def take_of(self, shard_id: str) -> StepFailure | None:
        """The pending refutation of `shard_id` (then forgotten), or None."""
        return self.take() if self.refutation is not None and self.refutation.shard_id == shard_id else None

    def summaries(self, node_id: str) -> list[IntegrityShardsVerified]:
        """The checks that found nothing wrong, per shard: one event per call (more only past the most shards one
        event may name)."""
        shards = [ShardVerification(shard_id=shard_id, checks=tally.checks,
                                    verified_positions=tally.verified_positions)
                  for shard_id, tally in self._tally.items() if tally.checks]
        return [IntegrityShardsVerified(node_id=node_id, pipeline_id=self.call.pipeline_id,
                                        shards=shards[start:start + max_verified_shards])
                for start in range(0, len(shards), max_verified_shards)]
