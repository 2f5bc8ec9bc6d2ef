"""ActivationReceiver: takes one hop's frames, acks each chunk, and hands out complete steps in arrival order."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from hearth.protocol.subjects import LinkNodes, ack_subject, activation_subject
from hearth.services.common.config import TransportSettings
from hearth.services.common.config_processes import ShardSettings
from hearth.services.transport.errors import FrameError, TransportClosed, TransportTimeout, WaitInterrupted
from hearth.services.transport.frames import AddOutcome, ReceivedStep, StepAssembler
from hearth.services.transport.headers import AckHeader, FrameHeader
from hearth.services.transport.link_auth import LinkAuth
from hearth.services.transport.limits import StepLimits, StepRefusal
from hearth.services.transport.ready import ReadySteps, ready_budget_steps
from hearth.services.transport.receiver_drops import ReceiverDrops, StepKey
from hearth.services.transport.stats import ReceiverStats
from hearth.services.transport.subscription import SubscribingEndpoint
from hearth.services.transport.wire import conversion_offload_bytes

log = logging.getLogger(__name__)

_defaults = TransportSettings()
# A pipeline receiver that hears nothing this long ends `async for` with TransportTimeout: its
# orchestrator is gone (the host's eviction idle time).
_default_idle_timeout_s = ShardSettings.model_fields["eviction_idle_s"].default

# Called with a refused frame's header and why it was refused (a hop tells its orchestrator about its session's).
RefusalListener = Callable[[FrameHeader, StepRefusal], Awaitable[None]]
# Partial steps whose declared bytes may be held at once, in steps of the largest size the pipeline allows: a
# pipeline assembles one step per hop at a time, so anything beyond is abandoned, oldest first.
partial_budget_steps = 2


class _PartialStep:
    __slots__ = ("assembler", "decode_s", "last_arrival_ns")

    def __init__(self, assembler: StepAssembler) -> None:
        self.assembler = assembler
        self.decode_s = 0.0
        self.last_arrival_ns = 0


class ActivationReceiver(SubscribingEndpoint, ReceiverDrops):
    """Subscribes to ``hearth.act.<receiver node>.<pipeline_id>.<hop>`` and acks on
    ``hearth.ack.<sender node>.<pipeline_id>.<hop>`` (``nodes``: the two ends of the link).

    Steps come out whole (``await receiver.next_step(timeout_s)`` or ``async for step in receiver``) in the order they
    complete. Per session, a step at or below the newest step already handed out is stale: dropped, and not acked (an
    ack says this hop took the chunk in, and the stall watch blames the hop holding a step; an honest sender never
    sends one); duplicates of chunks already placed are acked and dropped. When a newer step of a session completes,
    older unfinished steps of that session are abandoned. Step numbers stay monotonic across a reset.

    Backpressure: at most `max_ready_steps` complete steps, two of the largest at most in bytes (ready.py), wait for
    the consumer; beyond that the receiver stops taking (and acking) frames, which blocks the sender once its window
    is full. A step that finds no room within `ready_wait_timeout_s` is dropped (counted in stats.dropped_steps).

    Memory: a frame that starts a step is checked before anything is allocated for the step: against
    `step_limits` (the pipeline's hidden size, positions, wire dtype and chunk count,
    hearth/services/transport/limits.py) and `max_step_bytes`. A refused frame is dropped, counted (stats.refused_frames
    and `hearth_activation_frames_refused_total`) and, when `on_refused` is given, reported to it, so a hop can fail
    its session's step at once instead of waiting for it. Unfinished steps together hold at most
    `max_partial_bytes` (two of the largest steps); the oldest is abandoned to make room.

    With `acks=False` it is a tap: the same frames, opened with the same link key, but no acks and no backpressure
    on the sender (a tap whose consumer falls behind drops steps instead).
    """

    def __init__(self, nc: NatsClient, pipeline_id: str, hop: int, *, nodes: LinkNodes = LinkNodes(),
                 max_ready_steps: int = _defaults.max_ready_steps,
                 ready_wait_timeout_s: float = _defaults.ready_wait_timeout_s,
                 idle_timeout_s: float = _default_idle_timeout_s, max_step_bytes: int = _defaults.max_step_bytes,
                 max_partial_steps: int = _defaults.max_partial_steps,
                 max_tracked_sessions: int = _defaults.max_tracked_sessions, step_limits: StepLimits | None = None,
                 on_refused: RefusalListener | None = None, link_key: bytes | None = None, seal: bool = False,
                 acks: bool = True, ack_witness_key: bytes | None = None) -> None:
        if max_ready_steps < 1 or (seal and link_key is None):
            raise ValueError(f"max_ready_steps must be at least 1 (got {max_ready_steps}); a sealed link needs its key")
        self.nc = nc
        self.pipeline_id = pipeline_id
        self.hop = hop
        self.max_ready_steps = max_ready_steps
        self.ready_wait_timeout_s = ready_wait_timeout_s
        self.idle_timeout_s = idle_timeout_s
        # The pipeline's own bound, when it is known, is far below the transport-wide one.
        self.max_step_bytes = min(max_step_bytes, step_limits.max_step_bytes) if step_limits else max_step_bytes
        self.max_partial_bytes = partial_budget_steps * self.max_step_bytes
        self.max_partial_steps = max_partial_steps
        self.step_limits = step_limits
        self._on_refused = on_refused
        self.max_tracked_sessions = max_tracked_sessions
        self.nodes = nodes
        self.acks = acks  # False: a tap (see the class docstring)
        # With a key, only frames carrying its MAC are taken (`seal`: only frames sealed with its seal key), and
        # acks carry the MAC too, and this hop's witness (hearth/services/transport/link_auth.py).
        self.link_key = link_key
        self._auth = LinkAuth(link_key, sealed=seal, ack_witness_key=ack_witness_key) if link_key is not None else None
        self.subject = activation_subject(pipeline_id, hop, nodes)
        self.ack_subject = ack_subject(pipeline_id, hop, nodes)
        self.stats = ReceiverStats()
        self._partial: dict[StepKey, _PartialStep] = {}
        self._newest_delivered: OrderedDict[str, int] = OrderedDict()
        self._ready = ReadySteps(max_ready_steps, ready_budget_steps * self.max_step_bytes)
        self._getters: deque[asyncio.Future[None]] = deque()
        self._interrupted = False
        self._room_waiter: asyncio.Future[None] | None = None
        self._sub: Subscription | None = None
        self._closed = False

    def _subscription(self):
        return self.subject, self._on_frame

    @property
    def ready_steps(self) -> int:
        return len(self._ready)

    async def next_step(self, timeout_s: float | None = None) -> ReceivedStep:
        """The next complete step; TransportTimeout after `timeout_s` (default idle_timeout_s),
        TransportClosed once closed and drained."""
        limit_s = self.idle_timeout_s if timeout_s is None else timeout_s
        deadline = time.perf_counter() + limit_s
        while not self._ready:
            if self._closed:
                raise TransportClosed(f"receiver of hop {self.hop} of pipeline {self.pipeline_id} is closed")
            if self._interrupted:
                self._interrupted = False
                raise WaitInterrupted(f"wait for hop {self.hop} of pipeline {self.pipeline_id} interrupted")
            remaining_s = deadline - time.perf_counter()
            getter = asyncio.get_running_loop().create_future()
            self._getters.append(getter)
            try:
                if remaining_s <= 0:
                    raise asyncio.TimeoutError
                # asyncio.timeout rather than wait_for: the step is handed over one loop iteration sooner.
                async with asyncio.timeout(remaining_s):
                    await getter
            except asyncio.TimeoutError:
                raise TransportTimeout(
                    f"hop {self.hop} of pipeline {self.pipeline_id}: no complete step within {limit_s} s",
                    pipeline_id=self.pipeline_id,
                    hop=self.hop,
                    waited_s=limit_s,
                ) from None
            finally:
                if getter in self._getters:
                    self._getters.remove(getter)
        received = self._ready.popleft()
        self._room_freed()
        return received

    def take_ready(self) -> list[ReceivedStep]:
        """Every complete step waiting, without waiting for more."""
        taken = self._ready.take_all()
        self._room_freed()
        return taken

    def _room_freed(self) -> None:
        if self._room_waiter is not None and not self._room_waiter.done():
            self._room_waiter.set_result(None)

    def __aiter__(self) -> "ActivationReceiver":
        return self

    async def __anext__(self) -> ReceivedStep:
        try:
            return await self.next_step()
        except TransportClosed:
            raise StopAsyncIteration from None

    def forget_session(self, session: str) -> None:
        """Drop a finished session's partial steps and its stale-step watermark."""
        for key in [key for key in self._partial if key[0] == session]:
            del self._partial[key]
        self._newest_delivered.pop(session, None)

    async def close(self) -> None:
        """Unsubscribe (which cancels the subscription's task) and wake every waiter."""
        if self._closed:
            return
        self._closed = True
        for getter in self._getters:
            if not getter.done():
                getter.set_result(None)
        if self._room_waiter is not None and not self._room_waiter.done():
            self._room_waiter.set_exception(TransportClosed("receiver closed"))
        await self._unsubscribe()
        self._partial.clear()

    async def _on_frame(self, msg: Msg) -> None:
        arrived_ns = time.time_ns()
        started = time.perf_counter()
        payload = msg.data if self._auth is None else self._auth.open_frame(msg.headers, msg.data)
        if payload is None:
            self._unauthenticated(unsealed=self._auth is not None and self._auth.frame_was_unsealed(msg.headers))
            return
        try:
            header = FrameHeader.from_nats_headers(msg.headers)
            if header.pipeline_id != self.pipeline_id or header.hop != self.hop:
                raise FrameError(
                    f"frame for pipeline {header.pipeline_id} hop {header.hop} arrived on {self.subject}"
                )
        except FrameError as error:
            self._bad_frame(error)
            return
        key = (header.session, header.step)
        newest = self._newest_delivered.get(header.session)
        if newest is not None and header.step <= newest:
            self.stats.stale_chunks += 1
            return
        partial = self._partial.get(key)
        if partial is None:
            refusal = self._refusal(header)
            if refusal is not None:
                await self._refuse(header, refusal)
                return
            if len(self._partial) >= self.max_partial_steps:
                self._abandon(next(iter(self._partial)), "too many unfinished steps")
            self._make_room_for(header.total_bytes)
            partial = _PartialStep(StepAssembler(header))
            self._partial[key] = partial
        try:
            outcome = partial.assembler.add(header, payload)
        except FrameError as error:
            self._partial.pop(key, None)
            self.stats.dropped_steps += 1
            self._bad_frame(error)
            return
        partial.last_arrival_ns = arrived_ns
        if outcome is AddOutcome.duplicate:
            self.stats.duplicate_chunks += 1
            await self._ack(header)
            return
        self.stats.chunks_received += 1
        self.stats.bytes_received += len(payload)
        if outcome is AddOutcome.added:
            partial.decode_s += time.perf_counter() - started
            await self._ack(header)
            return
        del self._partial[key]
        try:
            received = await self._complete(partial, started)
        except (FrameError, RuntimeError, ValueError) as error:
            self.stats.dropped_steps += 1
            self._bad_frame(FrameError(f"step {header.step} (session {header.session}) could not be restored: {error}"))
            return
        if not await self._wait_for_room(received):
            return
        self._deliver(received)
        await self._ack(header)

    async def _complete(self, partial: _PartialStep, started: float) -> ReceivedStep:
        assembler = partial.assembler
        first = assembler.header
        needs_conversion = first.dtype is not None and first.restored_dtype is not first.dtype
        if needs_conversion and first.total_bytes >= conversion_offload_bytes:
            tensor = await asyncio.to_thread(assembler.tensor)
        else:
            tensor = assembler.tensor()
        decode_s = partial.decode_s + (time.perf_counter() - started)
        first_sent_ns = assembler.first_sent_ns
        wire_s = None
        if first_sent_ns is not None:
            wire_s = max(0, partial.last_arrival_ns - first_sent_ns) / 1e9
            self.stats.wire.add(wire_s)
        self.stats.decode.add(decode_s)
        return ReceivedStep(first, tensor, first_sent_ns, partial.last_arrival_ns, wire_s, decode_s)

    async def _wait_for_room(self, received: ReceivedStep) -> bool:
        """Hold this frame (and every later one, and their acks) until the consumer takes a step."""
        if self._ready.room_for(received):
            return True
        deadline = time.perf_counter() + self.ready_wait_timeout_s
        while not self._ready.room_for(received):
            remaining_s = deadline - time.perf_counter()
            waiter = asyncio.get_running_loop().create_future()
            self._room_waiter = waiter
            try:
                if remaining_s <= 0:
                    raise TimeoutError
                # asyncio.timeout, not wait_for: on 3.11 wait_for drops a cancellation (a receive loop stopped)
                # that lands as room is made.
                async with asyncio.timeout(remaining_s):
                    await waiter
            except TimeoutError:
                self.stats.dropped_steps += 1
                log.warning(
                    "hop %s of pipeline %s: consumer took no step for %s s; dropping step %s of session %s",
                    self.hop, self.pipeline_id, self.ready_wait_timeout_s, received.step, received.session,
                )
                return False
            except TransportClosed:
                return False
            finally:
                self._room_waiter = None
        return True

    def interrupt_waiters(self) -> None:
        """Make the pending (or, if none, the next) next_step() without a step ready raise WaitInterrupted."""
        self._interrupted = True
        while self._getters:
            getter = self._getters.popleft()
            if not getter.done():
                getter.set_result(None)

    def _deliver(self, received: ReceivedStep) -> None:
        session, step = received.session, received.step
        self._newest_delivered[session] = step
        self._newest_delivered.move_to_end(session)
        while len(self._newest_delivered) > self.max_tracked_sessions:
            self._newest_delivered.popitem(last=False)
        for key in [key for key in self._partial if key[0] == session and key[1] < step]:
            self._abandon(key, f"step {step} completed first")
        self._ready.append(received)
        self.stats.steps_received += 1
        while self._getters:
            getter = self._getters.popleft()
            if not getter.done():
                getter.set_result(None)
                break

    async def _ack(self, header: FrameHeader) -> None:
        if not self.acks:
            return
        ack = AckHeader.for_frame(header, acked_ns=time.time_ns())
        headers = ack.to_nats_headers()
        if self._auth is not None:
            self._auth.sign_ack(headers)
        try:
            await self.nc.publish(self.ack_subject, b"", headers=headers)
        except Exception as error:  # a lost ack only delays the sender (it times out and reports the hop)
            log.warning("hop %s of pipeline %s: ack publish failed: %s", self.hop, self.pipeline_id, error)
