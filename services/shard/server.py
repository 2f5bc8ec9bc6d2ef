"""ShardServer: hosts one layer range, advertises and heartbeats it, and serves pipeline hops over NATS.

Integrity: every step's input is checked (NaN, Inf, per-position L2 norm far above what this shard has
received before) before its layers run. The norm bounds are kept per shard, across pipelines, keyed by
the first layer the hop runs (the input of layer L has the same scale whoever sends it, and a shard used
from different first layers sees different inputs): a per-pipeline bound would learn nothing before a
pipeline's first frame, so a shard corrupting from its first step on would pass. A failing step is not
run or passed on; an IntegrityNotice goes to `integrity_subject(pipeline_id)`, where the orchestrator
blames the hop that produced the frame and fails over away from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from pydantic import ValidationError

from events.models import ShardAdvertised, ShardHeartbeat, ShardWithdrawn
from events.publish import publish_event
from events.streams import ensure_streams
from inference import LayerRangeRunner
from services.common.compute import StepThreads, on_compute_thread, use_intra_op_threads
from services.common.control_protocol import (
    CloseHop,
    ControlReply,
    IntegrityNotice,
    OpenHop,
    ShardStat,
    StatShard,
    control_request_adapter,
    integrity_subject,
)
from services.shard.faults import ShardFault
from services.shard.metrics import ShardStepMetrics
from services.transport import (
    AckWindowSender,
    ActivationReceiver,
    FrameKind,
    ReceivedStep,
    TransportClosed,
    TransportError,
    TransportTimeout,
    wire_dtype_from_setting,
)
from services.transport.integrity import NormBounds, count_integrity_failure

log = logging.getLogger(__name__)

heartbeat_interval_s = 2.0
advertisement_ttl_s = 60.0
# A hop whose orchestrator went away without closing it is dropped after this long without a step.
hop_idle_timeout_s = 600.0
hop_ack_timeout_s = 30.0
# How long closing a hop waits for its serving task to end (a step being computed finishes first).
hop_close_timeout_s = 5.0
latency_samples_kept = 256


@dataclass(frozen=True)
class ShardIdentity:
    """What this shard is, as advertised."""

    shard_id: str
    model_id: str
    node_id: str
    weights_sha256: str
    layer_lo: int
    layer_hi: int
    total_layers: int
    dtype: str
    memory_required_mb: float
    control_subject: str


@dataclass
class _OpenHop:
    request: OpenHop
    receiver: ActivationReceiver
    sender: AckWindowSender
    task: asyncio.Task | None = None
    closed: bool = False


@dataclass
class _ServingStats:
    tokens_served_total: int = 0
    steps_in_compute: int = 0
    step_latencies_s: deque = field(default_factory=lambda: deque(maxlen=latency_samples_kept))

    def p95_latency_ms(self) -> float:
        if not self.step_latencies_s:
            return 0.0
        ordered = sorted(self.step_latencies_s)
        return 1000.0 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


class ShardServer:
    """Serves `open`/`close` on its control subject and runs each open hop's steps through its runner."""

    def __init__(
        self,
        nc: NatsClient,
        runner: LayerRangeRunner,
        identity: ShardIdentity,
        *,
        max_concurrent_streams: int = 4,
        hop_weight: float = 1.0,
        heartbeat_interval_s: float = heartbeat_interval_s,
        ttl_s: float = advertisement_ttl_s,
        window_chunks: int = 16,
        chunk_bytes: int | None = None,
        fault: ShardFault | None = None,
        step_threads: StepThreads | None = None,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.runner = runner
        self.identity = identity
        self.max_concurrent_streams = max_concurrent_streams
        self.hop_weight = hop_weight
        self.heartbeat_interval_s = heartbeat_interval_s
        self.ttl_s = ttl_s
        self.window_chunks = window_chunks
        self.chunk_bytes = chunk_bytes
        self.fault = fault or ShardFault()
        self.step_threads = step_threads or StepThreads()
        self.stats = _ServingStats()
        self.step_metrics = ShardStepMetrics(identity.shard_id)
        self._hops: dict[str, _OpenHop] = {}
        # Running bounds of the inputs received, per first layer run (see the module docstring).
        self._input_bounds: dict[int, NormBounds] = {}
        self._control_sub = None
        self._background: list[asyncio.Task] = []
        self._readvertise = asyncio.Event()
        self._stopped = False

    @property
    def active_streams(self) -> int:
        return len(self._hops)

    async def start(self) -> None:
        await ensure_streams(self.js)
        self._control_sub = await self.nc.subscribe(self.identity.control_subject, cb=self._on_control)
        await self.nc.flush(timeout=5)
        await self.advertise()
        self._background = [
            asyncio.create_task(self._heartbeat_loop(), name="shard-heartbeat"),
            asyncio.create_task(self._advertise_loop(), name="shard-advertise"),
        ]
        log.info("shard %s serving layers %d-%d on %s", self.identity.shard_id, self.identity.layer_lo,
                 self.identity.layer_hi, self.identity.control_subject)

    def request_readvertise(self) -> None:
        """Called after a reconnect: a restarted broker may have lost nothing, but routing must see us at once."""
        self._readvertise.set()

    async def advertise(self) -> None:
        ident = self.identity
        await publish_event(self.js, ShardAdvertised(
            node_id=ident.node_id, shard_id=ident.shard_id, model_id=ident.model_id,
            weights_sha256=ident.weights_sha256, layer_lo=ident.layer_lo, layer_hi=ident.layer_hi,
            total_layers=ident.total_layers, dtype=ident.dtype, memory_required_mb=ident.memory_required_mb,
            max_concurrent_streams=self.max_concurrent_streams, control_subject=ident.control_subject,
            hop_weight=self.hop_weight, ttl_s=self.ttl_s,
        ))

    async def heartbeat(self) -> None:
        queue_depth = self.stats.steps_in_compute + sum(h.receiver.ready_steps for h in self._hops.values())
        await publish_event(self.js, ShardHeartbeat(
            node_id=self.identity.node_id, shard_id=self.identity.shard_id, queue_depth=queue_depth,
            active_streams=self.active_streams, p95_latency_ms=self.stats.p95_latency_ms(),
            tokens_served_total=self.stats.tokens_served_total,
        ))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            try:
                await self.heartbeat()
            except Exception as error:  # the broker may be restarting; the next beat tries again
                log.warning("heartbeat not published: %s", error)

    async def _advertise_loop(self) -> None:
        # Re-advertise well inside the TTL so the advertisement never expires while we are alive.
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._readvertise.wait(), timeout=self.ttl_s / 3)
            self._readvertise.clear()
            try:
                await ensure_streams(self.js)
                await self.advertise()
            except Exception as error:
                log.warning("advertisement not published: %s", error)

    async def stop(self, reason: str = "shutdown") -> None:
        if self._stopped:
            return
        self._stopped = True
        for task in self._background:
            task.cancel()
        for task in self._background:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._control_sub is not None:
            with contextlib.suppress(Exception):
                await self._control_sub.unsubscribe()
        for pipeline_id in list(self._hops):
            await self._close_hop(pipeline_id)
        try:
            await publish_event(self.js, ShardWithdrawn(
                node_id=self.identity.node_id, shard_id=self.identity.shard_id, reason=reason), timeout_s=2.0,
                max_attempts=2)
        except Exception as error:
            log.warning("withdrawal not published: %s", error)

    # ---------------------------------------------------------------- control

    async def _on_control(self, msg: Msg) -> None:
        try:
            request = control_request_adapter.validate_json(msg.data)
        except ValidationError as error:
            await self._reply(msg, ControlReply(ok=False, code="bad_request", message=str(error)[:500]))
            return
        if isinstance(request, StatShard):
            await self._reply(msg, await self.stat())
            return
        if isinstance(request, CloseHop):
            hop = self._hops.get(request.pipeline_id)
            # A close naming an older session (sent before a failover re-opened this pipeline) is stale.
            if hop is not None and request.session_id in (None, hop.request.session_id):
                await self._close_hop(request.pipeline_id)
            await self._reply(msg, ControlReply(ok=True))
            return
        await self._reply(msg, await self._open_hop(request))

    async def _reply(self, msg: Msg, reply: ControlReply | ShardStat) -> None:
        if msg.reply:
            reply.shard_id = self.identity.shard_id
            await msg.respond(reply.model_dump_json().encode())

    async def stat(self) -> ShardStat:
        """What this shard holds right now (answers `stat`; also a liveness probe for the orchestrator)."""
        cached_sessions, cache_bytes = await asyncio.to_thread(
            lambda: (len(self.runner.session_ids()), self.runner.cache_bytes))
        return ShardStat(shard_id=self.identity.shard_id, active_streams=self.active_streams,
                         open_pipelines=sorted(self._hops), cached_sessions=cached_sessions,
                         cache_bytes=cache_bytes)

    async def _open_hop(self, request: OpenHop) -> ControlReply:
        ident = self.identity
        if request.weights_sha256 != ident.weights_sha256 or request.model_id != ident.model_id:
            return ControlReply(ok=False, code="weights_mismatch",
                                message=f"this shard serves {ident.model_id} with weights {ident.weights_sha256}")
        if not (ident.layer_lo <= request.layer_lo <= request.layer_hi <= ident.layer_hi):
            return ControlReply(ok=False, code="bad_range",
                                message=f"layers {request.layer_lo}-{request.layer_hi} are not inside "
                                        f"{ident.layer_lo}-{ident.layer_hi}")
        if request.pipeline_id in self._hops:
            # A re-open (failover reuses this hop with a new session): start over cleanly.
            await self._close_hop(request.pipeline_id)
        if len(self._hops) >= self.max_concurrent_streams:
            return ControlReply(ok=False, code="at_capacity",
                                message=f"{len(self._hops)} of {self.max_concurrent_streams} streams in use")
        receiver = ActivationReceiver(self.nc, request.pipeline_id, request.hop, idle_timeout_s=hop_idle_timeout_s)
        sender = AckWindowSender(self.nc, request.pipeline_id, request.hop + 1, window_chunks=self.window_chunks,
                                 ack_timeout_s=hop_ack_timeout_s, chunk_bytes=self.chunk_bytes,
                                 wire_dtype=wire_dtype_from_setting(request.wire_dtype))
        await receiver.start()
        await sender.start()
        hop = _OpenHop(request, receiver, sender)
        hop.task = asyncio.create_task(self._serve_hop(hop), name=f"hop-{request.pipeline_id}-{request.hop}")
        self._hops[request.pipeline_id] = hop
        log.info("opened hop %d of pipeline %s (layers %d-%d)", request.hop, request.pipeline_id,
                 request.layer_lo, request.layer_hi)
        return ControlReply(ok=True)

    async def _close_hop(self, pipeline_id: str) -> None:
        hop = self._hops.pop(pipeline_id, None)
        if hop is None:
            return
        # Not only a cancel: on Python 3.11 a wait_for inside the serving loop can swallow a cancellation that
        # lands just as a step arrives. The flag and the closed receiver end the loop whatever it awaited.
        hop.closed = True
        await hop.receiver.close()
        await hop.sender.close()
        if hop.task is not None and hop.task is not asyncio.current_task():
            hop.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(hop.task), timeout=hop_close_timeout_s)
        freed = await on_compute_thread(self.runner.reset, hop.request.session_id)
        log.info("closed pipeline %s (freed %d cache bytes)", pipeline_id, freed)

    # ---------------------------------------------------------------- compute

    async def _serve_hop(self, hop: _OpenHop) -> None:
        request = hop.request
        while True:
            try:
                received = await hop.receiver.next_step(timeout_s=hop_idle_timeout_s)
            except TransportTimeout:
                log.info("pipeline %s idle for %s s; closing its hop", request.pipeline_id, hop_idle_timeout_s)
                self._hops.pop(request.pipeline_id, None)
                await hop.receiver.close()
                await hop.sender.close()
                await on_compute_thread(self.runner.reset, request.session_id)
                return
            except TransportClosed:
                return
            if hop.closed:
                return
            if received.session != request.session_id:
                continue  # a frame of an earlier session of this pipeline (before a failover)
            try:
                await self._run_step(hop, received)
            except TransportError as error:
                log.warning("pipeline %s hop %d: could not pass step %d on: %s", request.pipeline_id,
                            request.hop, received.step, error)
            except Exception as error:
                # The orchestrator notices the missing step and fails over; the hop keeps serving.
                log.warning("pipeline %s hop %d: step %d failed: %s", request.pipeline_id, request.hop,
                            received.step, error)

    async def _run_step(self, hop: _OpenHop, received: ReceivedStep) -> None:
        request = hop.request
        if received.kind is FrameKind.reset:
            await on_compute_thread(self.runner.reset, request.session_id)
            await hop.sender.send(received.info, None)
            return
        started = time.perf_counter()
        self.stats.steps_in_compute += 1
        try:
            if self.fault.delay_s and self.fault.active:
                await asyncio.sleep(self.fault.delay_s)
            # One worker-thread trip per step (on a busy machine every hand-off costs a wake-up): the input
            # check, then the layers only if it passed.
            threads = self.step_threads.for_streams(len(self._hops))
            failed_check, output = await on_compute_thread(self._check_and_forward, request, received, threads)
        finally:
            self.stats.steps_in_compute -= 1
        if failed_check is not None:
            await self._report_unsound_input(hop, received, failed_check)
            return
        output = self.fault.corrupt(output)
        compute_s = time.perf_counter() - started
        self.stats.step_latencies_s.append(compute_s)
        self.stats.tokens_served_total += int(received.tensor.shape[1])
        sent = await hop.sender.send(received.info, output)
        self.step_metrics.observe(received.kind.value, wire_s=received.wire_s, deserialize_s=received.decode_s,
                                  serialize_s=sent.encode_s, compute_s=compute_s)

    def _check_and_forward(self, request: OpenHop, received: ReceivedStep,
                           threads: int) -> tuple[str | None, torch.Tensor | None]:
        """On the compute thread: check the step's input and run the layers only if it is sound (never garbage)."""
        use_intra_op_threads(threads)
        bounds = self._input_bounds.setdefault(request.layer_lo, NormBounds())
        failed_check = bounds.check(received.tensor)
        if failed_check is not None:
            return failed_check, None
        return None, self.runner.forward(request.session_id, received.tensor, received.pos, received.kind.value,
                                         (request.layer_lo, request.layer_hi))

    async def _report_unsound_input(self, hop: _OpenHop, received: ReceivedStep, failed_check) -> None:
        """Tell the orchestrator that a step's input failed a check; the step was dropped."""
        request = hop.request
        count_integrity_failure(failed_check, "hop_input")
        log.warning("pipeline %s hop %d: step %d input failed the %s check; dropped", request.pipeline_id,
                    request.hop, received.step, failed_check)
        notice = IntegrityNotice(pipeline_id=request.pipeline_id, session_id=request.session_id,
                                 hop=request.hop, step=received.step, check=failed_check)
        await self.nc.publish(integrity_subject(request.pipeline_id), notice.model_dump_json().encode())
