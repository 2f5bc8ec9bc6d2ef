"""PipelineRun: one Call from routing to its final frame: embed, pump steps through a chain, sample, stream;
on a StepFailure, repair the chain (fail over away from the shard at fault, or rebuild it after the broker
came back) and re-prefill the prompt plus every generated token; fall back to a local model; record events.

The router is asked once per construction or repair: one read of the candidates, then every refusal while
opening is routed around in memory on the same rows (ShardRouter.plan); a second read comes only after
catching up with the event log, when the first rows could not cover the model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch
from nats.aio.client import Client as NatsClient

from events.models import (
    IntegrityCorruptionDetected,
    PipelineAborted,
    PipelineCompleted,
    PipelineConstructed,
    PipelineFailover,
    PipelineFallbackLocal,
    PipelineFirstToken,
    PipelineShardStatus,
)
from events.outbox import EventOutbox
from inference import SamplingParams, TextStream
from inference.compute_thread import on_compute_thread
from inference.head_batch import HeadRow
from readmodels.runner import Projector
from services.common.chat_protocol import (
    DoneFrame,
    PipelineAbortedFrame,
    PipelineFrame,
    ShardFailoverFrame,
    ShardStatusFrame,
    Timing,
    TokenDeltaFrame,
    Usage,
)
from services.common.config import HearthSettings
from services.orchestrator.call import Call
from services.orchestrator.capacity import ShardLoad
from services.orchestrator.catalog import ModelCatalog
from services.orchestrator.chain import HopChain, LocalChain
from services.orchestrator.head_batcher import HeadSteps
from services.orchestrator.health import RecentFailures
from services.orchestrator.metrics import observe_event
from services.orchestrator.prefill import prefill
from services.orchestrator.router import Hop, RoutingError, ShardRouter
from services.orchestrator.stall import StepFailure
from services.transport import FrameKind
from services.transport.integrity import NormBounds

log = logging.getLogger(__name__)


@dataclass
class RunContext:
    """What every call of one orchestrator shares."""

    nc: NatsClient
    node_id: str
    settings: HearthSettings
    router: ShardRouter
    projector: Projector
    catalog: ModelCatalog
    outbox: EventOutbox
    recent_failures: RecentFailures
    # Every call's per-token head work, batched across the calls decoding at once.
    head_steps: HeadSteps
    # Per model: bounds of the activations that reach us (the sink's integrity check), shared by all calls.
    sink_bounds: dict[str, NormBounds]
    # The streams this orchestrator holds on each shard and the shards that just refused it (live routing room).
    load: ShardLoad
    running_calls: int = 0


@dataclass
class Decoding:
    """One call's sampling state: parameters, random generator, detokenizer and stop rules."""

    params: SamplingParams
    generator: torch.Generator | None
    text_stream: TextStream


class PipelineRun:
    """Serves one Call; frames go to `call.client`, events to the context's outbox."""

    def __init__(self, call: Call, ctx: RunContext) -> None:
        self.call = call
        self.ctx = ctx
        self.transport = ctx.settings.transport
        self.policy = ctx.settings.research.distributed_inference
        self.chain: HopChain | LocalChain | None = None
        # The shards of the open chain counted in the context's ShardLoad (released on close).
        self._held: list[str] = []

    async def run(self) -> None:
        # The prompt was tokenized when the call was admitted (services/orchestrator/admission.py).
        call, head = self.call, self.call.model.head
        request = call.request
        params = SamplingParams(temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
                                seed=request.seed, max_tokens=request.max_tokens, stop=tuple(request.stop))
        decoding = Decoding(params, params.make_generator(), head.text_stream(params, call.prompt_ids))
        try:
            self.chain = await self._construct()
        except RoutingError as error:
            await self._fall_back_or_abort(decoding, error.code, error.message)
            return
        await self._record(PipelineConstructed(
            node_id=self.ctx.node_id, pipeline_id=call.pipeline_id, request_id=request.request_id,
            model_id=call.model.model_id, weights_sha256=call.model.weights_sha256, hops=self.chain.shard_ids,
            construct_ms=call.construct_ms, caller=call.caller))
        await call.client.send(PipelineFrame(seq=0, pipeline_id=call.pipeline_id, hops=self.chain.shard_ids))
        while True:
            outcome = await self._generate(self.chain, decoding)
            if isinstance(outcome, str):
                await self._complete(outcome)
                return
            if self._reprefill_after_eviction(outcome):
                continue
            if not await self._repair(outcome, decoding):
                return

    async def keep_alive(self) -> None:
        """Tell the hops of the current chain that this call lives (the client is told by the service)."""
        if self.chain is not None:
            await self.chain.keep_alive()

    async def close(self) -> None:
        """Free every hop's session (called whatever way the call ended)."""
        chain, self.chain = self.chain, None
        if chain is not None:
            await chain.close()
        held, self._held = self._held, []
        if held:
            # After the closes went out: the shards read them before any later open of ours.
            self.ctx.load.release(held)

    def _opened(self, chain: HopChain) -> HopChain:
        self.ctx.load.hold(chain.shard_ids)
        self._held = list(chain.shard_ids)
        return chain

    # ------------------------------------------------------------------ routing

    async def _construct(self) -> HopChain:
        """Open a chain over what the router plans, routing around refusals and waiting while the shards that
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
            chain = self._chain_over(hops)
            failure = await chain.open()
            if failure is None:
                call.construct_ms = (time.perf_counter() - started) * 1000.0
                # A failover's chain serves the same scheme, so greedy output stays identical.
                call.quantization = hops[0].quantization
                return self._opened(chain)
            await chain.close()
            if failure.shard_id is None:
                raise RoutingError("shard_unavailable", failure.reason)
            if failure.code == "at_capacity":
                # Full for now (another orchestrator's streams): a replica, or a wait; never a reason to fail.
                log.info("pipeline %s: %s; trying a replica or waiting", call.pipeline_id, failure)
                self.ctx.load.refused(failure.shard_id)
                continue
            log.info("pipeline %s: %s; routing around it", call.pipeline_id, failure)
            call.excluded.add(failure.shard_id)

    def _only_room_lacks(self, candidates) -> bool:
        """Whether a chain could be planned if every shard had room (then waiting for room is worth it)."""
        try:
            self._plan(candidates, load=None)
        except RoutingError:
            return False
        return True

    def _chain_over(self, hops: list[Hop]) -> HopChain:
        model = self.call.model
        # No step of this call reaches beyond its prompt plus max_tokens: every hop refuses frames that would.
        return HopChain(self.ctx.nc, self.call.pipeline_id, hops, node_id=self.ctx.node_id, model_id=model.model_id,
                        weights_sha256=model.weights_sha256, transport=self.transport, accusers=self.call.accusers,
                        wire_dtype=self.policy.activation_dtype,
                        sink_bounds=self.ctx.sink_bounds.setdefault(model.model_id, NormBounds()),
                        hidden_size=model.head.info.hidden_size,
                        max_session_tokens=len(self.call.prompt_ids) + self.call.request.max_tokens,
                        on_round_trip=self.ctx.load.observe_round_trip)

    async def _catch_up(self) -> None:
        timeout_s = self.ctx.settings.orchestrator.catch_up_timeout_s
        try:
            await self.ctx.projector.wait_until_caught_up(timeout_s=timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            log.warning("routing read model still behind the event log after %s s", timeout_s)

    def _plan(self, candidates, *, load: ShardLoad | None) -> list[Hop]:
        router, model, excluded = self.ctx.router, self.call.model, self.call.excluded
        route = dict(now=router.now(), load=load, quantization=self.call.quantization)
        penalised = self.ctx.recent_failures.current() - excluded
        if penalised:
            # Shards that just failed other requests are the last resort, not a reason to give up.
            try:
                return router.plan(candidates, model.model_id, model.weights_sha256, exclude=excluded | penalised,
                                   **route)
            except RoutingError:
                pass
        return router.plan(candidates, model.model_id, model.weights_sha256, exclude=excluded, **route)

    # ------------------------------------------------------------------ repair

    def _reprefill_after_eviction(self, failure: StepFailure) -> bool:
        """A hop's session was evicted (KV budget or idle): re-prefill on the same chain, within the bound."""
        call = self.call
        if failure.kind != "evicted" or call.eviction_reprefills >= self.policy.max_eviction_reprefills:
            return False
        call.eviction_reprefills += 1
        log.info("pipeline %s: %s; re-prefilling %d tokens", call.pipeline_id, failure, len(call.known_ids))
        return True

    async def _repair(self, failure: StepFailure, decoding: Decoding) -> bool:
        """Replace the failed chain; False when the call has ended instead (fallback ran, or aborted)."""
        if failure.shard_id is None:
            return await self._rebuild_after_broker_loss(failure, decoding)
        call, ctx = self.call, self.ctx
        log.warning("pipeline %s: %s", call.pipeline_id, failure)
        # Events blame a shard only on what we verified; a hop's `reported` word reroutes this call, no other.
        if failure.kind == "corrupt" and failure.check:
            await self._record(IntegrityCorruptionDetected(node_id=ctx.node_id, pipeline_id=call.pipeline_id,
                                                           shard_id=failure.shard_id, check=failure.check))
        status = dict(shard_id=failure.shard_id, status="degraded", reason=failure.reason)
        if failure.verified:
            ctx.recent_failures.add(failure.shard_id)
            await self._record(PipelineShardStatus(node_id=ctx.node_id, pipeline_id=call.pipeline_id, **status))
        await call.client.send(ShardStatusFrame(seq=0, **status))
        await self.close()
        call.excluded.add(failure.shard_id)
        # `fallback_to_local_after_failures` failovers are allowed; the failure after them falls back.
        if call.failovers >= self.policy.fallback_to_local_after_failures:
            await self._fall_back_or_abort(decoding, "shard_unavailable",
                                           f"{call.failovers} failovers; last: {failure}")
            return False
        try:
            self.chain = await self._construct()
        except RoutingError as error:
            await self._fall_back_or_abort(decoding, "shard_unavailable",
                                           f"no replacement for {failure.shard_id}: {error.message}")
            return False
        call.failovers += 1
        resumed_at = len(call.generated)
        await self._record(PipelineFailover(
            node_id=ctx.node_id, pipeline_id=call.pipeline_id, failed_shard_id=failure.shard_id,
            replacement_hops=self.chain.shard_ids, reason=failure.kind, resumed_at_token=resumed_at))
        await call.client.send(ShardFailoverFrame(seq=0, failed_shard_id=failure.shard_id,
                                                  replacement_hops=self.chain.shard_ids, resumed_at_token=resumed_at))
        return True

    async def _rebuild_after_broker_loss(self, failure: StepFailure, decoding: Decoding) -> bool:
        """Our broker connection dropped mid-step: no shard is to blame. Once we (and the same hops, and the
        client) are reachable again, reopen the same hops and carry on; `pipeline_stalled` naming the broker
        when that does not happen within `[orchestrator] broker_wait_s`."""
        call, nc = self.call, self.ctx.nc
        settings = self.ctx.settings
        hops = list(self.chain.hops) if isinstance(self.chain, HopChain) else None
        await self.close()
        call.broker_repairs += 1
        log.warning("pipeline %s: %s; rebuilding it once the broker is back", call.pipeline_id, failure)
        if hops is None or call.broker_repairs > settings.orchestrator.max_broker_repairs:
            await self._abort("pipeline_stalled", f"{failure.reason} (rebuilt {call.broker_repairs - 1} times)")
            return False
        deadline = time.monotonic() + settings.orchestrator.broker_wait_s
        while time.monotonic() < deadline:
            if nc.is_connected and await call.client.reachable(settings.transport.control_timeout_s):
                chain = self._chain_over(hops)
                reopened = await chain.open()
                if reopened is None:
                    self.chain = self._opened(chain)
                    return True
                await chain.close()
                if reopened.kind == "refused":  # a shard answered and said no: route around it as usual
                    return await self._repair(reopened, decoding)
            # The hops' own connections may come back a little after ours.
            await asyncio.sleep(settings.nats.reconnect_wait_s)
        await self._abort("pipeline_stalled", f"{failure.reason}; not back within "
                                              f"{settings.orchestrator.broker_wait_s:.0f} s")
        return False

    async def _fall_back_or_abort(self, decoding: Decoding, code: str, reason: str) -> None:
        call = self.call
        local = None
        if self.policy.fallback_to_local and call.request.params.fallback_to_local:
            local = await self.ctx.catalog.local_model_for(call.model, call.quantization)
        if local is None:
            await self._abort(code, reason)
            return
        await self.close()
        await self._record(PipelineFallbackLocal(node_id=self.ctx.node_id, pipeline_id=call.pipeline_id,
                                                 reason=reason))
        self.chain = LocalChain(local)
        await self._complete(await self._generate(self.chain, decoding))

    # ------------------------------------------------------------------ generation

    async def _generate(self, chain: HopChain | LocalChain, decoding: Decoding) -> str | StepFailure:
        """Re-prefill everything known so far through `chain`, then decode until a stop or max_tokens; the
        finish reason, or the failure that stopped the chain."""
        hidden = await on_compute_thread(self.call.model.head.embed, self.call.known_ids)
        output = await prefill(chain, hidden, self.ctx.settings.orchestrator.prefill_chunk_tokens)
        with self.ctx.head_steps.decoding():
            return await self._decode(chain, decoding, output)

    async def _decode(self, chain: HopChain | LocalChain, decoding: Decoding,
                      output: torch.Tensor | StepFailure) -> str | StepFailure:
        call, params = self.call, decoding.params
        while True:
            if isinstance(output, StepFailure):
                return output
            # One compute-thread trip per token, shared with the other calls' (HeadSteps): sample, and embed the
            # sampled token for the next step (wasted only on the last token).
            token_id, next_hidden = await self.ctx.head_steps.next_token(
                call.model.head, HeadRow(output, params, decoding.generator), call=call.pipeline_id)
            call.generated.append(token_id)
            delta = decoding.text_stream.push(token_id)
            first_token = call.first_token_at is None
            if first_token:
                call.first_token_at = time.perf_counter()
            text, finish_reason = delta.text, (delta.finish_reason or "stop") if delta.finished else None
            if finish_reason is None and len(call.generated) >= params.max_tokens:
                # Release text held back for a possible stop string together with the last token.
                text += decoding.text_stream.finish("length").text
                finish_reason = "length"
            if text or not delta.finished:
                await call.client.send(TokenDeltaFrame(seq=0, text=text, token_id=token_id, hops=chain.shard_ids))
            if first_token:
                await self._record(PipelineFirstToken(node_id=self.ctx.node_id, pipeline_id=call.pipeline_id,
                                                      ttft_ms=call.ttft_ms()))
            if finish_reason is not None:
                return finish_reason
            # The position of the token just sampled, which the next step feeds in.
            position = len(call.prompt_ids) + len(call.generated) - 1
            output = await chain.step(FrameKind.decode, position, next_hidden)

    # ------------------------------------------------------------------ endings

    async def _record(self, event) -> None:
        observe_event(event)
        await self.ctx.outbox.record(event)

    async def _complete(self, finish_reason: str) -> None:
        call = self.call
        duration_ms = call.seconds_since_start() * 1000.0
        tokens_per_second = call.decode_tokens_per_second()
        await call.client.send(DoneFrame(
            seq=0, finish_reason=finish_reason,
            usage=Usage(prompt_tokens=len(call.prompt_ids), completion_tokens=call.completion_tokens),
            timing=Timing(ttft_ms=call.ttft_ms(), tokens_per_second=tokens_per_second, duration_ms=duration_ms,
                          construct_ms=call.construct_ms, failovers=call.failovers,
                          queue_wait_ms=call.queue_wait_ms()),
        ))
        await self._record(PipelineCompleted(
            node_id=self.ctx.node_id, pipeline_id=call.pipeline_id, prompt_tokens=len(call.prompt_ids),
            completion_tokens=call.completion_tokens, duration_ms=duration_ms,
            tokens_per_second=tokens_per_second, finish_reason=finish_reason))

    async def record_client_gone(self) -> None:
        """The run was cancelled because nobody reads its frames any more: record how it ended."""
        await self._record(PipelineAborted(node_id=self.ctx.node_id, pipeline_id=self.call.pipeline_id,
                                           code="client_gone", reason="the client stopped listening"))

    async def _abort(self, code: str, reason: str) -> None:
        await self._record(PipelineAborted(node_id=self.ctx.node_id, pipeline_id=self.call.pipeline_id, code=code,
                                           reason=reason))
        await self.call.client.send(PipelineAbortedFrame(seq=0, code=code, reason=reason))
