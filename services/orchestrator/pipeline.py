"""PipelineRun: one chat request from routing to `done`: embed, pump steps through a chain, sample, stream,
fail over (re-prefilling prompt plus generated tokens), fall back to a local model, record events."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from events.models import (
    EventEnvelope,
    IntegrityCorruptionDetected,
    PipelineAborted,
    PipelineCompleted,
    PipelineConstructed,
    PipelineFailover,
    PipelineFallbackLocal,
    PipelineFirstToken,
    PipelineShardStatus,
)
from inference import SamplingParams
from services.common.compute import on_compute_thread, use_intra_op_threads
from services.common.chat_protocol import (
    ChatRequest,
    DoneFrame,
    PipelineAbortedFrame,
    PipelineFrame,
    ShardFailoverFrame,
    ShardStatusFrame,
    Timing,
    TokenDeltaFrame,
    Usage,
)
from services.orchestrator.catalog import LoadedModel
from services.orchestrator.chain import HopChain, HopFailure, LocalChain, StepTimeouts, default_gone_check_after_s
from services.orchestrator.health import RecentFailures
from services.orchestrator.router import RoutingError, ShardRouter
from services.transport import FrameKind
from services.transport.integrity import NormBounds

log = logging.getLogger(__name__)

# Refusals (a shard at capacity) are routed around without counting as failovers, but not forever.
max_open_attempts = 8


@dataclass(frozen=True)
class PipelinePolicy:
    step_timeout_s: float = 10.0
    prefill_timeout_per_token_s: float = 0.01
    gone_check_after_s: float = default_gone_check_after_s
    fallback_to_local: bool = True
    fallback_to_local_after_failures: int = 2
    wire_dtype: str = "auto"
    window_chunks: int = 16
    chunk_bytes: int | None = None


@dataclass
class GenerationState:
    prompt_ids: list[int]
    generated: list[int] = field(default_factory=list)
    first_token_at: float | None = None


class PipelineRun:
    """Serves one request; every frame goes through `emit`, every event through `record`."""

    def __init__(
        self,
        *,
        nc,
        node_id: str,
        request: ChatRequest,
        model: LoadedModel,
        router: ShardRouter,
        policy: PipelinePolicy,
        emit: Callable[[object], Awaitable[None]],
        record: Callable[[EventEnvelope], Awaitable[None]],
        local_model_lookup: Callable[[], Awaitable[object | None]],
        sink_bounds: NormBounds,
        catch_up: Callable[[], Awaitable[None]] | None = None,
        recent_failures: RecentFailures | None = None,
        step_threads: Callable[[], int] | None = None,
    ) -> None:
        self.nc = nc
        self.node_id = node_id
        self.request = request
        self.model = model
        self.router = router
        self.policy = policy
        self.emit = emit
        self.record = record
        self.local_model_lookup = local_model_lookup
        self.sink_bounds = sink_bounds
        # Intra-op threads for this run's next compute step (fewer while other pipelines run; see StepThreads).
        self.step_threads = step_threads
        self.catch_up = catch_up
        self.recent_failures = recent_failures
        self.pipeline_id = "p-" + uuid.uuid4().hex[:16]
        self.started = time.perf_counter()
        self.failovers = 0
        self.excluded: set[str] = set()
        self.chain: HopChain | LocalChain | None = None

    # ------------------------------------------------------------------ entry

    async def run(self) -> None:
        head = self.model.head
        request = self.request
        if request.messages is not None:
            messages = [m.model_dump() for m in request.messages]
            prompt_ids = await on_compute_thread(head.encode_chat, messages)
        else:
            prompt_ids = await on_compute_thread(head.encode_prompt, request.prompt)
        params = SamplingParams(temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
                                seed=request.seed, max_tokens=request.max_tokens, stop=tuple(request.stop))
        state = GenerationState(prompt_ids=list(prompt_ids))
        generator = params.make_generator()
        text_stream = head.text_stream(params, prompt_ids)
        try:
            self.chain = await self._build_chain(first=True)
        except RoutingError as error:
            if not await self._try_fallback(state, params, generator, text_stream, reason=error.message):
                await self._abort(error.code, error.message)
            return
        while True:
            try:
                finish_reason = await self._generate(self.chain, state, params, generator, text_stream)
                await self._complete(state, finish_reason)
                return
            except HopFailure as failure:
                if not await self._fail_over(failure, state):
                    if not await self._try_fallback(state, params, generator, text_stream,
                                                    reason=f"{self.failovers} failovers; last: {failure.reason}"):
                        await self._abort("shard_unavailable", f"no replacement for {failure.shard_id}: "
                                          f"{failure.reason}")
                    return

    async def close(self) -> None:
        """Free every hop's session (called whatever way the request ended)."""
        chain, self.chain = self.chain, None
        if chain is not None:
            await chain.close()

    # ------------------------------------------------------------------ routing

    async def _build_chain(self, *, first: bool) -> HopChain:
        """Pick and open hops; shards refusing to open are excluded and routed around."""
        started = time.perf_counter()
        for _attempt in range(max_open_attempts):
            hops = await self._pick()
            chain = HopChain(
                self.nc, self.pipeline_id, hops, model_id=self.model.model_id,
                weights_sha256=self.model.weights_sha256,
                timeouts=StepTimeouts(self.policy.step_timeout_s, self.policy.prefill_timeout_per_token_s,
                                      self.policy.gone_check_after_s),
                wire_dtype=self.policy.wire_dtype, window_chunks=self.policy.window_chunks,
                chunk_bytes=self.policy.chunk_bytes, sink_bounds=self.sink_bounds,
            )
            try:
                await chain.open()
            except HopFailure as failure:
                await chain.close()
                log.info("pipeline %s: %s; routing around it", self.pipeline_id, failure)
                self.excluded.add(failure.shard_id)
                continue
            construct_ms = (time.perf_counter() - started) * 1000.0
            if first:
                await self.record(PipelineConstructed(
                    node_id=self.node_id, pipeline_id=self.pipeline_id, request_id=self.request.request_id,
                    model_id=self.model.model_id, weights_sha256=self.model.weights_sha256,
                    hops=chain.shard_ids, construct_ms=construct_ms))
                await self.emit(PipelineFrame(seq=0, pipeline_id=self.pipeline_id, hops=chain.shard_ids))
            self.construct_ms = construct_ms
            return chain
        raise RoutingError("shard_unavailable", f"every candidate shard refused after {max_open_attempts} tries")

    async def _pick(self):
        pick = self.router.pick
        model_id, weights = self.model.model_id, self.model.weights_sha256
        penalised = self.recent_failures.current() - self.excluded if self.recent_failures else set()
        if penalised:
            # Shards that just failed other requests are the last resort, not a reason to give up.
            with contextlib.suppress(RoutingError):
                return await asyncio.to_thread(pick, model_id, weights, self.excluded | penalised)
        try:
            return await asyncio.to_thread(pick, model_id, weights, self.excluded)
        except RoutingError:
            if self.catch_up is None:
                raise
        # The read model may trail the event log by a few milliseconds (a shard that just advertised):
        # decide "unavailable" only on a caught-up read model.
        await self.catch_up()
        return await asyncio.to_thread(pick, model_id, weights, self.excluded)

    async def _fail_over(self, failure: HopFailure, state: GenerationState) -> bool:
        """Mark the shard degraded, route around it, reopen; False when the call must fall back or abort."""
        log.warning("pipeline %s: %s", self.pipeline_id, failure)
        if failure.kind == "corrupt" and failure.check:
            await self.record(IntegrityCorruptionDetected(
                node_id=self.node_id, pipeline_id=self.pipeline_id, shard_id=failure.shard_id,
                check=failure.check))
        await self.record(PipelineShardStatus(node_id=self.node_id, pipeline_id=self.pipeline_id,
                                              shard_id=failure.shard_id, status="degraded", reason=failure.reason))
        await self.emit(ShardStatusFrame(seq=0, shard_id=failure.shard_id, status="degraded",
                                         reason=failure.reason))
        await self.close()
        self.excluded.add(failure.shard_id)
        if self.recent_failures is not None:
            self.recent_failures.add(failure.shard_id)
        # `fallback_to_local_after_failures` failovers are allowed; the failure after them falls back.
        if self.failovers >= self.policy.fallback_to_local_after_failures:
            return False
        try:
            self.chain = await self._build_chain(first=False)
        except RoutingError as error:
            log.warning("pipeline %s: no replacement for %s: %s", self.pipeline_id, failure.shard_id,
                        error.message)
            return False
        self.failovers += 1
        await self.record(PipelineFailover(
            node_id=self.node_id, pipeline_id=self.pipeline_id, failed_shard_id=failure.shard_id,
            replacement_hops=self.chain.shard_ids, reason=failure.kind, resumed_at_token=len(state.generated)))
        await self.emit(ShardFailoverFrame(seq=0, failed_shard_id=failure.shard_id,
                                           replacement_hops=self.chain.shard_ids,
                                           resumed_at_token=len(state.generated)))
        return True

    async def _try_fallback(self, state, params, generator, text_stream, *, reason: str) -> bool:
        if not (self.policy.fallback_to_local and self.request.params.fallback_to_local):
            return False
        local = await self.local_model_lookup()
        if local is None:
            return False
        await self.close()
        await self.record(PipelineFallbackLocal(node_id=self.node_id, pipeline_id=self.pipeline_id, reason=reason))
        self.chain = LocalChain(local)
        finish_reason = await self._generate(self.chain, state, params, generator, text_stream)
        await self._complete(state, finish_reason)
        return True

    # ------------------------------------------------------------------ generation

    async def _generate(self, chain, state: GenerationState, params: SamplingParams, generator,
                        text_stream) -> str:
        """Re-prefill everything known so far through `chain`, then decode until a stop or max_tokens."""
        head = self.model.head
        known = state.prompt_ids + state.generated
        hidden = await on_compute_thread(head.embed, known)
        output = await chain.step(FrameKind.prefill, 0, hidden)
        while True:
            # One worker-thread trip per token (hand-offs cost most on a busy machine): sample, and embed
            # the sampled token for the next step (wasted only on the last token).
            token_id, next_hidden = await on_compute_thread(self._sample_and_embed, output, params, generator,
                                                            self.step_threads() if self.step_threads else None)
            state.generated.append(token_id)
            delta = text_stream.push(token_id)
            first_token = state.first_token_at is None
            if first_token:
                state.first_token_at = time.perf_counter()
            text, finish_reason = delta.text, (delta.finish_reason or "stop") if delta.finished else None
            if finish_reason is None and len(state.generated) >= params.max_tokens:
                # Release text held back for a possible stop string together with the last token.
                text += text_stream.finish("length").text
                finish_reason = "length"
            if text or not delta.finished:
                await self.emit(TokenDeltaFrame(seq=0, text=text, token_id=token_id, hops=chain.shard_ids))
            if first_token:
                # After the frame: the JetStream publish waits for an fsync the client need not wait for.
                await self.record(PipelineFirstToken(node_id=self.node_id, pipeline_id=self.pipeline_id,
                                                     ttft_ms=(state.first_token_at - self.started) * 1000.0))
            if finish_reason is not None:
                return finish_reason
            position = len(state.prompt_ids) + len(state.generated) - 1
            output = await chain.step(FrameKind.decode, position, next_hidden)

    def _sample(self, output: torch.Tensor, params: SamplingParams, generator) -> int:
        head = self.model.head
        return head.sample(head.logits(output), params, generator)

    def _sample_and_embed(self, output: torch.Tensor, params: SamplingParams, generator,
                          threads: int | None = None) -> tuple[int, torch.Tensor]:
        if threads is not None:
            use_intra_op_threads(threads)
        token_id = self._sample(output, params, generator)
        return token_id, self.model.head.embed([token_id])

    # ------------------------------------------------------------------ endings

    async def _complete(self, state: GenerationState, finish_reason: str) -> None:
        duration_s = time.perf_counter() - self.started
        decode_s = time.perf_counter() - (state.first_token_at or self.started)
        completion = len(state.generated)
        tokens_per_second = (completion - 1) / decode_s if completion > 1 and decode_s > 0 else 0.0
        ttft_ms = ((state.first_token_at or time.perf_counter()) - self.started) * 1000.0
        await self.record(PipelineCompleted(
            node_id=self.node_id, pipeline_id=self.pipeline_id, prompt_tokens=len(state.prompt_ids),
            completion_tokens=completion, duration_ms=duration_s * 1000.0,
            tokens_per_second=tokens_per_second, finish_reason=finish_reason))
        await self.emit(DoneFrame(
            seq=0, finish_reason=finish_reason,
            usage=Usage(prompt_tokens=len(state.prompt_ids), completion_tokens=completion),
            timing=Timing(ttft_ms=ttft_ms, tokens_per_second=tokens_per_second, duration_ms=duration_s * 1000.0,
                          construct_ms=getattr(self, "construct_ms", None), failovers=self.failovers),
        ))

    async def record_client_gone(self) -> None:
        """The run was cancelled because nobody reads its frames any more: record how it ended."""
        await self.record(PipelineAborted(node_id=self.node_id, pipeline_id=self.pipeline_id,
                                          code="client_gone", reason="the client stopped listening"))

    async def _abort(self, code: str, reason: str) -> None:
        await self.record(PipelineAborted(node_id=self.node_id, pipeline_id=self.pipeline_id, code=code,
                                          reason=reason))
        await self.emit(PipelineAbortedFrame(seq=0, code=code, reason=reason))
