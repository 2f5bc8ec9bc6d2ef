"""ChainBuilder: opens a call's chain of shard hops over what the router plans, routing around the shards that
refuse it and waiting while the shards that could serve it are full.

The router is asked once per construction: one read of the candidates, then every refusal while opening is
routed around in memory on the same rows (ShardRouter.plan); a second read comes only after catching up with the
event log, when the first rows could not cover the model.
"""

from __future__ import annotations

import asyncio
import logging
import time

from events.streams import MiB

from services.orchestrator.call import Call
from services.orchestrator.capacity import ShardLoad
from services.orchestrator.chain import HopChain
from services.orchestrator.context import RunContext
from services.orchestrator.recovery import SHARD_UNAVAILABLE
from services.orchestrator.router import Hop, RoutingError
from services.transport.integrity import NormBounds

log = logging.getLogger(__name__)


class ChainBuilder:
    """Builds the chains of one call (its first, and each failover's), over the call's exclusions."""

    def __init__(self, call: Call, ctx: RunContext, *, record: bool = False) -> None:
        self.call = call
        self.ctx = ctx
        # What its chains may hold of their hops' work for checks (services/orchestrator/recording.py; None: none).
        self.record_budget_bytes = int(ctx.settings.verification.record_budget_mb * MiB) if record else None

    async def build(self) -> HopChain:
        """An open chain over what the router plans, routing around refusals and waiting while the shards that
        could serve are full; RoutingError when nothing covers the model any more (or room never came)."""
        call = self.call
        started = time.perf_counter()
        router, model_id = self.ctx.router, call.model.model_id
        candidates = await asyncio.to_thread(router.candidates, model_id)
        caught_up = False
        while True:
            try:
                hops = self._plan(candidates, load=self.ctx.load)
            except RoutingError:
                if not caught_up:
                    # The read model may trail the event log by milliseconds (a shard that just advertised):
                    # decide "unavailable" only on a caught-up one.
                    await self._catch_up()
                    candidates, caught_up = await asyncio.to_thread(router.candidates, model_id), True
                    continue
                if not self._only_room_lacks(candidates):
                    raise
                waited_s, settings = time.perf_counter() - started, self.ctx.settings.orchestrator
                if waited_s > settings.at_capacity_max_wait_s:
                    raise RoutingError("overloaded", f"no shard had room for this call within {waited_s:.0f} s "
                                                     f"(at_capacity_max_wait_s); retry later")
                await self.ctx.load.wait_for_room(settings.at_capacity_retry_s)
                candidates = await asyncio.to_thread(router.candidates, model_id)
                continue
            chain = self.over(hops)
            failure = await chain.open()
            if failure is None:
                call.construct_ms = (time.perf_counter() - started) * 1000.0
                # A failover's chain serves the same scheme, so greedy output stays identical.
                call.quantization = hops[0].quantization
                return chain
            await chain.close()
            if failure.shard_id is None:
                raise RoutingError(SHARD_UNAVAILABLE, failure.reason)
            if failure.code == "at_capacity":
                # Full for now (another orchestrator's streams): a replica, or a wait; never a reason to fail.
                log.info("pipeline %s: %s; trying a replica or waiting", call.pipeline_id, failure)
                self.ctx.load.refused(failure.shard_id)
                continue
            log.info("pipeline %s: %s; routing around it", call.pipeline_id, failure)
            call.excluded.add(failure.shard_id)

    def over(self, hops: list[Hop]) -> HopChain:
        """A chain (not opened yet) over exactly `hops`."""
        model, settings = self.call.model, self.ctx.settings
        # No step of this call reaches beyond its prompt plus max_tokens: every hop refuses frames that would.
        return HopChain(self.ctx.nc, self.call.pipeline_id, hops, node_id=self.ctx.node_id, model_id=model.model_id,
                        weights_sha256=model.weights_sha256, transport=settings.transport,
                        accusers=self.call.accusers,
                        wire_dtype=settings.research.distributed_inference.activation_dtype,
                        sink_bounds=self.ctx.sink_bounds.setdefault(model.model_id, NormBounds()),
                        hidden_size=model.head.info.hidden_size,
                        max_session_tokens=len(self.call.prompt_ids) + self.call.request.max_tokens,
                        on_round_trip=self.ctx.load.observe_round_trip, record_budget_bytes=self.record_budget_bytes)

    def _only_room_lacks(self, candidates) -> bool:
        """Whether a chain could be planned if every shard had room (then waiting for room is worth it)."""
        try:
            self._plan(candidates, load=None)
        except RoutingError:
            return False
        return True

    async def _catch_up(self) -> None:
        timeout_s = self.ctx.settings.orchestrator.catch_up_timeout_s
        try:
            await self.ctx.projector.wait_until_caught_up(timeout_s=timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            log.warning("routing read model still behind the event log after %s s", timeout_s)

    def _plan(self, candidates, *, load: ShardLoad | None) -> list[Hop]:
        router, model, excluded = self.ctx.router, self.call.model, self.call.excluded
        route = dict(now=router.now(), load=load, quantization=self.call.quantization)
        # Shards a check proved wrong are out at once (the read model quarantines them a moment later).
        excluded = excluded | self.ctx.quarantined
        penalised = self.ctx.recent_failures.current() - excluded
        if penalised:
            # Shards that just failed other requests are the last resort, not a reason to give up.
            try:
                return router.plan(candidates, model.model_id, model.weights_sha256, exclude=excluded | penalised,
                                   **route)
            except RoutingError:
                pass
        return router.plan(candidates, model.model_id, model.weights_sha256, exclude=excluded, **route)
