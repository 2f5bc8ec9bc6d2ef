"""AckWindowSender: publishes a step's frames into one hop, keeping at most `window_chunks` un-acked chunks."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from hearth.protocol.subjects import LinkNodes, ack_subject, activation_subject
from hearth.services.common.config import TransportSettings
from hearth.services.transport.errors import FrameError, TransportClosed, TransportError, TransportTimeout
from hearth.services.transport.frames import EncodedStep, effective_chunk_bytes, encode_step
from hearth.services.transport.headers import (
    HEADER_CHUNK, HEADER_OFFSET, HEADER_SENT_NS, AckHeader, FrameKind, StepInfo,
)
from hearth.services.transport.link_auth import LinkAuth
from hearth.services.transport.stats import SenderStats
from hearth.services.transport.subscription import SubscribingEndpoint
from hearth.services.transport.wire import WireDtype, conversion_offload_bytes

log = logging.getLogger(__name__)

# The defaults live in the settings model; ack_timeout_s defaults to the step timeout (a hop that holds a
# step longer than that is stalled anyway, so waiting longer for its ack buys nothing).
_defaults = TransportSettings()

ChunkKey = tuple[str, int, int]  # (session, step, chunk index): what an ack names
# How often a send waiting for window space looks whether our connection reconnected (and lost the acks meanwhile).
reconnect_check_s = 0.25


@dataclass(frozen=True)
class SentStep:
    """What send() did for one step."""

    info: StepInfo
    chunk_count: int
    total_bytes: int
    encode_s: float
    window_wait_s: float


@dataclass(frozen=True)
class WindowCheck:
    """What a send looks at every `every_s` while it waits for window space: `check` raises to give the step up
    (the orchestrator's stall watch, which finds a dead hop long before the ack timeout)."""

    every_s: float
    check: Callable[[], Awaitable[None]]


class AckWindowSender(SubscribingEndpoint):
    """Sends steps to ``hearth.act.<receiving node>.<pipeline_id>.<hop>`` and frees its window on
    ``hearth.ack.<sending node>.<pipeline_id>.<hop>``.

    At most `window_chunks` chunks are un-acked at any time; send() waits (at most `ack_timeout_s` per
    wait, then TransportTimeout) for acks before publishing more. Concurrent send() calls are served one
    whole step at a time, in call order. Use as ``async with AckWindowSender(...) as sender`` or call
    start() / close().

    An ack is cumulative within its session: the receiver takes a link's frames in the order they were published
    and acks them in that order, so once it acks a chunk, every chunk of that session published before it was acked
    or lost (an ack or a frame lost while either end's connection dropped). Those are settled with it (counted in
    stats.acks_lost) instead of holding a slot forever; a receiver that stops acking settles nothing. Once our own
    connection has reconnected, the chunks published before are settled too: the acks sent while our ack
    subscription was gone from the broker are lost, and a window full of them would wait for a later ack that is
    never sent (at most one window more in flight per reconnect).
    """

    def __init__(
        self,
        nc: NatsClient,
        pipeline_id: str,
        hop: int,
        *,
        nodes: LinkNodes = LinkNodes(),
        window_chunks: int = _defaults.window_chunks,
        ack_timeout_s: float = _defaults.step_timeout_s,
        chunk_bytes: int | None = None,
        wire_dtype: WireDtype | None = None,
        int8_block: int = _defaults.int8_block_elems,
        link_key: bytes | None = None,
        seal: bool = False,
    ) -> None:
        if window_chunks < 1:
            raise ValueError(f"window_chunks must be at least 1, got {window_chunks}")
        if ack_timeout_s <= 0:
            raise ValueError(f"ack_timeout_s must be positive, got {ack_timeout_s}")
        if seal and link_key is None:
            raise ValueError("a sealed link needs its link key")
        self.nc = nc
        self.pipeline_id = pipeline_id
        self.hop = hop
        self.window_chunks = window_chunks
        self.ack_timeout_s = ack_timeout_s
        self.chunk_bytes = effective_chunk_bytes(chunk_bytes, nc.max_payload or None)
        self.wire_dtype = wire_dtype
        self.int8_block = int8_block
        self.nodes = nodes
        # With a key, every frame carries its MAC (or, `seal`, is encrypted and authenticated with the link's seal
        # key instead) and only acks carrying the link's MAC free the window (hearth/services/transport/link_auth.py).
        self.link_key = link_key
        self._auth = LinkAuth(link_key, sealed=seal) if link_key is not None else None
        self.subject = activation_subject(pipeline_id, hop, nodes)
        self.ack_subject = ack_subject(pipeline_id, hop, nodes)
        self.stats = SenderStats()
        self._in_flight: dict[ChunkKey, float] = {}
        self._space_waiter: asyncio.Future[None] | None = None
        self._drained_waiters: list[asyncio.Future[None]] = []
        self._send_lock = asyncio.Lock()
        self._sub: Subscription | None = None
        self._closed = False
        self._reconnects: int | None = None  # our connection's reconnect count at the last look (none before a send)

    @property
    def in_flight_chunks(self) -> int:
        return len(self._in_flight)

    def _subscription(self):
        # The server must know the ack subscription before the first frame can be acked.
        return self.ack_subject, self._on_ack

    def _start_flush_timeout_s(self) -> float:
        return self.ack_timeout_s

    async def send(
        self,
        info: StepInfo,
        tensor: torch.Tensor | None,
        *,
        wire_dtype: WireDtype | None = None,
        while_waiting: WindowCheck | None = None,
    ) -> SentStep:
        """Publish one step (all its chunks); returns once every chunk is published, not acked. While it waits
        for window space, `while_waiting` is checked (whatever it raises ends the send)."""
        if self._closed:
            raise TransportClosed(f"sender to hop {self.hop} of pipeline {self.pipeline_id} is closed")
        if self._sub is None:
            raise TransportError("AckWindowSender.start() must be awaited before send()")
        started = time.perf_counter()
        encoded = await self._encode(info, tensor, wire_dtype or self.wire_dtype)
        encode_s = time.perf_counter() - started
        self.stats.encode.add(encode_s)
        await self._acquire_send_lock(info)
        try:
            window_wait_s = await self._publish(encoded, while_waiting)
        finally:
            self._send_lock.release()
        # nats-py writes to the socket from its flusher task, which runs only when we yield: yield now, so the
        # frames leave before the caller's bookkeeping rather than after it (they are the critical path).
        await asyncio.sleep(0)
        self.stats.steps_sent += 1
        return SentStep(info, encoded.chunk_count, encoded.total_bytes, encode_s, window_wait_s)

    async def send_reset(self, session: str, step: int) -> SentStep:
        """Tell the hop (and, forwarded, every later hop) to drop this session's cache."""
        return await self.send(StepInfo(session=session, step=step, kind=FrameKind.reset), None)

    async def wait_all_acked(self, timeout_s: float | None = None) -> None:
        """Wait until every published chunk is acked (TransportTimeout after `timeout_s`, default ack_timeout_s)."""
        if not self._in_flight:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._drained_waiters.append(waiter)
        limit_s = self.ack_timeout_s if timeout_s is None else timeout_s
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for drops a cancellation that lands as the last ack comes.
            async with asyncio.timeout(limit_s):
                await waiter
        except TimeoutError:
            self.stats.timeouts += 1
            oldest = min(self._in_flight, key=self._in_flight.__getitem__, default=None)
            session, step = (oldest[0], oldest[1]) if oldest else (None, None)
            raise TransportTimeout(
                f"hop {self.hop} of pipeline {self.pipeline_id}: {len(self._in_flight)} chunks still un-acked "
                f"after {limit_s} s (oldest: session {session} step {step})",
                pipeline_id=self.pipeline_id,
                hop=self.hop,
                session=session,
                step=step,
                waited_s=limit_s,
                in_flight_chunks=len(self._in_flight),
            ) from None
        finally:
            if waiter in self._drained_waiters:
                self._drained_waiters.remove(waiter)

    def forget_session(self, session: str) -> int:
        """Stop waiting for acks of a session's chunks (after a reset or an abort); returns how many."""
        stale = [key for key in self._in_flight if key[0] == session]
        for key in stale:
            del self._in_flight[key]
        self._after_release()
        return len(stale)

    def forget_all(self) -> int:
        """Empty the window (e.g. when the hop behind it was replaced); returns how many chunks were dropped."""
        count = len(self._in_flight)
        self._in_flight.clear()
        self._after_release()
        return count

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        error = TransportClosed(f"sender to hop {self.hop} of pipeline {self.pipeline_id} closed")
        for waiter in [self._space_waiter, *self._drained_waiters]:
            if waiter is not None and not waiter.done():
                waiter.set_exception(error)
        await self._unsubscribe()

    async def _encode(self, info: StepInfo, tensor: torch.Tensor | None, wire_dtype: WireDtype | None) -> EncodedStep:
        needs_conversion = (
            tensor is not None
            and wire_dtype is not None
            and wire_dtype.torch_dtype != tensor.dtype
            and tensor.numel() * tensor.element_size() >= conversion_offload_bytes
        )
        arguments = dict(wire_dtype=wire_dtype, chunk_bytes=self.chunk_bytes, int8_block=self.int8_block)
        if needs_conversion:
            return await asyncio.to_thread(encode_step, info, tensor, **arguments)
        return encode_step(info, tensor, **arguments)

    async def _acquire_send_lock(self, info: StepInfo) -> None:
        if not self._send_lock.locked():
            await self._send_lock.acquire()
            return
        try:
            async with asyncio.timeout(self.ack_timeout_s):  # not wait_for: it may drop a cancellation (3.11)
                await self._send_lock.acquire()
        except TimeoutError:
            self.stats.timeouts += 1
            raise self._timeout(info, "another step's send held the hop", self.ack_timeout_s) from None

    async def _publish(self, encoded: EncodedStep, while_waiting: WindowCheck | None) -> float:
        info = encoded.info
        headers = encoded.header(self.pipeline_id, self.hop, 0).to_nats_headers()
        count = encoded.chunk_count
        waited_s = 0.0
        for index, chunk in enumerate(encoded.chunks):
            self._settle_if_reconnected()
            if len(self._in_flight) >= self.window_chunks:
                waited_s += await self._wait_for_space(info, while_waiting)
            # nats-py serialises the headers inside publish() before it yields, so reusing the dict is safe.
            headers[HEADER_CHUNK] = f"{index}/{count}"
            if HEADER_OFFSET in headers:
                headers[HEADER_OFFSET] = str(encoded.offsets[index])
            headers[HEADER_SENT_NS] = str(time.time_ns())
            payload = self._auth.protect_frame(headers, chunk) if self._auth is not None else chunk
            key = (info.session, info.step, index)
            self._in_flight[key] = time.perf_counter()
            try:
                await self.nc.publish(self.subject, payload, headers=headers)
            except Exception as error:
                self._in_flight.pop(key, None)
                raise TransportError(
                    f"publishing step {info.step} (session {info.session}) to hop {self.hop} of pipeline "
                    f"{self.pipeline_id} failed: {error!r}"
                ) from error
            self.stats.chunks_sent += 1
            self.stats.bytes_sent += len(chunk)
        return waited_s

    async def _wait_for_space(self, info: StepInfo, while_waiting: WindowCheck | None) -> float:
        started = time.perf_counter()
        deadline = started + self.ack_timeout_s
        self.stats.window_waits += 1
        while not self._settle_if_reconnected() and len(self._in_flight) >= self.window_chunks:
            remaining_s = deadline - time.perf_counter()
            if remaining_s <= 0:
                self.stats.timeouts += 1
                raise self._timeout(info, "no ack freed the window", self.ack_timeout_s)
            waiter = asyncio.get_running_loop().create_future()
            self._space_waiter = waiter
            try:
                every_s = reconnect_check_s if while_waiting is None else min(reconnect_check_s, while_waiting.every_s)
                async with asyncio.timeout(min(remaining_s, every_s)):  # not wait_for: it may drop a cancellation
                    await waiter
            except TimeoutError:
                if while_waiting is not None:
                    await while_waiting.check()
            finally:
                self._space_waiter = None
        waited_s = time.perf_counter() - started
        self.stats.window_wait.add(waited_s)
        return waited_s

    def _timeout(self, info: StepInfo, reason: str, waited_s: float) -> TransportTimeout:
        return TransportTimeout(
            f"hop {self.hop} of pipeline {self.pipeline_id}: {reason} within {waited_s} s while sending step "
            f"{info.step} of session {info.session} ({len(self._in_flight)} of {self.window_chunks} chunks un-acked)",
            pipeline_id=self.pipeline_id,
            hop=self.hop,
            session=info.session,
            step=info.step,
            waited_s=waited_s,
            in_flight_chunks=len(self._in_flight),
        )

    async def _on_ack(self, msg: Msg) -> None:
        if self._auth is not None and not self._auth.ack_is_valid(msg.headers, msg.data):
            self.stats.bad_acks += 1
            log.debug("ignoring an ack without this link's MAC on %s", self.ack_subject)
            return
        try:
            ack = AckHeader.from_nats_headers(msg.headers)
        except FrameError as error:
            self.stats.bad_acks += 1
            log.warning("ignoring bad ack on %s: %s", self.ack_subject, error)
            return
        if ack.pipeline_id != self.pipeline_id or ack.hop != self.hop:
            self.stats.bad_acks += 1
            log.warning("ignoring ack for pipeline %s hop %s on %s", ack.pipeline_id, ack.hop, self.ack_subject)
            return
        acked = (ack.session, ack.step, ack.chunk_index)
        sent_at = self._in_flight.get(acked)
        if sent_at is None:
            return  # a duplicate ack, or one for a chunk we stopped waiting for
        self.stats.ack_rtt.add(time.perf_counter() - sent_at)
        self.stats.acks_lost += self._settle_through(acked)
        self._after_release()

    def _settle_if_reconnected(self) -> bool:
        """Settle every chunk in flight when our connection reconnected since the last look; whether it did."""
        reconnects, self._reconnects = self._reconnects, self.nc.stats["reconnects"]
        if reconnects is None or reconnects == self._reconnects:
            return False
        self.stats.acks_lost += len(self._in_flight)
        self._in_flight.clear()
        self._after_release()
        return True

    def _settle_through(self, acked: ChunkKey) -> int:
        """Drop `acked` and every chunk of its session published before it (the window is in publishing order);
        how many of those earlier ones were settled without their own ack."""
        earlier = []
        for key in self._in_flight:
            if key == acked:
                break
            if key[0] == acked[0]:
                earlier.append(key)
        for key in [*earlier, acked]:
            del self._in_flight[key]
        return len(earlier)

    def _after_release(self) -> None:
        waiter = self._space_waiter
        if waiter is not None and not waiter.done() and len(self._in_flight) < self.window_chunks:
            waiter.set_result(None)
        if not self._in_flight and self._drained_waiters:
            for drained in self._drained_waiters:
                if not drained.done():
                    drained.set_result(None)
