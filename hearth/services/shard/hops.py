"""ServedHop: one pipeline hop on a shard: receive a session's steps, run them through ShardCompute, pass the
output on, tell the orchestrator at once (a HopNotice, with the MAC of this hop's own notice key) when a step
cannot be passed on, and notice when the orchestrator has gone silent.

A step that cannot be passed on is never dropped silently: when its input fails an integrity check the
notice reports the hop before (`input_failed_check`: the orchestrator routes around it for the call but cannot
verify it, so blames nobody), as it does when the step's header does not continue the session's cache (a position
past it, a session never prefilled here) or is a `reset` (no orchestrator sends one): the hop before may write any
header; when the layers raise it blames this
hop (`step_failed`); either way the orchestrator fails over at once instead of waiting for a step timeout.

Liveness of the orchestrator: every step and every keepalive on the pipeline's keepalive subject that carries this
hop's MAC (hearth/services/transport/keepalives.py) counts as a sign of life (`last_heard`). The shard's watchdog
closes a hop that heard nothing for `orphan_timeout_s` (its orchestrator was killed, or lost the broker), freeing
its KV cache. A hop whose orchestrator lives but that received no step for `[shard] eviction_idle_s` stays open, but
its KV cache is evicted (as is the least recently used one when the caches outgrow `kv_cache_budget_mb`): its next
step is answered `session_evicted`, and the orchestrator re-prefills.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from hearth.protocol.subjects import LinkNodes
from hearth.inference import SessionEvictedError, SessionStateError
from hearth.services.common.config import TransportSettings
from hearth.protocol.control import CloseHop, HopNotice, HopProblem, KeepHop, OpenHop, PrefixBlocks
from hearth.protocol.subjects import hop_notice_subject, keepalive_subject
from hearth.services.shard.compute import ShardCompute
from hearth.services.transport import (
    AckWindowSender,
    ActivationReceiver,
    FrameHeader,
    FrameKind,
    ReceivedStep,
    StepLimits,
    StepRefusal,
    TransportClosed,
    TransportError,
    TransportTimeout,
    receiver_settings,
    wire_dtype_from_setting,
)
from hearth.services.transport.integrity import count_integrity_failure
from hearth.services.transport.keepalives import keepalive_key, keepalive_number
from hearth.services.transport.key_seal import proves_owner
from hearth.services.transport.mac import ack_witness_key, decode_link_key
from hearth.services.transport.notices import notice_message

log = logging.getLogger(__name__)

# The HopNotice check sent when this hop's input was refused for its declared shape, dtype, size or positions (the
# message says which); like the others, it accuses the hop before this one.
refused_input_check = "shape"
# HopNotice refuses a longer message: ours are cut to fit rather than lost.
notice_message_chars = next(bound.max_length for bound in HopNotice.model_fields["message"].metadata
                            if hasattr(bound, "max_length"))


@dataclass(frozen=True)
class HopLimits:
    """The timeouts and window of every hop a shard serves (from the settings; see ShardServer)."""

    idle_timeout_s: float
    orphan_timeout_s: float
    close_timeout_s: float
    transport: TransportSettings


def _link_key(encoded: str | None) -> bytes | None:
    return decode_link_key(encoded) if encoded is not None else None


class ServedHop:
    """An opened hop: its receiver, its sender to the next hop, its keepalive subscription and serving task."""

    def __init__(self, nc: NatsClient, request: OpenHop, compute: ShardCompute, limits: HopLimits,
                 node_id: str, *, opener: str | None = None, opener_key: str | None = None) -> None:
        self.nc = nc
        self.request = request
        self.compute = compute
        self.limits = limits
        # Steps of this pipeline are [1, tokens, hidden] within the session's positions: anything else is refused
        # before the receiver allocates for it, and a refused step of our session is reported at once.
        step_limits = StepLimits.for_pipeline(hidden_size=compute.runner.info.hidden_size,
                                              max_tokens=request.max_session_tokens,
                                              activation_dtype=request.wire_dtype)
        # Only this hop and its orchestrator know it: our notices, and the witness on our acks, speak for this hop.
        self._notice_key = _link_key(request.notice_key)
        self.receiver = ActivationReceiver(nc, request.pipeline_id, request.hop,
                                           nodes=LinkNodes(sender=request.upstream_node, receiver=node_id),
                                           link_key=_link_key(request.inbound_link_key),
                                           seal=request.seal_activations,
                                           idle_timeout_s=limits.idle_timeout_s, step_limits=step_limits,
                                           **receiver_settings(limits.transport),
                                           on_refused=self._on_refused_input, ack_witness_key=None
                                           if self._notice_key is None else ack_witness_key(self._notice_key))
        self._last_refused_step: int | None = None
        self.sender = AckWindowSender(nc, request.pipeline_id, request.hop + 1,
                                      nodes=LinkNodes(sender=node_id, receiver=request.downstream_node),
                                      link_key=_link_key(request.outbound_link_key),
                                      seal=request.seal_activations,
                                      window_chunks=limits.transport.window_chunks,
                                      ack_timeout_s=limits.transport.hop_ack_timeout_s,
                                      chunk_bytes=limits.transport.chunk_bytes,
                                      wire_dtype=wire_dtype_from_setting(request.wire_dtype))
        self.last_heard = self.last_step = time.monotonic()
        self.closed = False
        # Who opened it (ShardServer._opened; None on an open mesh): the share of the shard's hops it counts against,
        # whose hops alone may attach the blocks it keeps, and the source its inputs teach the norm bounds for.
        self.opener = opener
        self.opener_key = opener_key  # the key its open was signed with: a removal of it in the log closes the hop
        self._last_received: int | None = None  # the last step of its session received
        self._keeping = False  # a `keep` of this hop is running on the compute thread
        # Set once the server's `open` of this hop has ended (served, failed or cancelled): a close waits for it.
        self.open_settled = asyncio.Event()
        self._keepalive_sub = None
        # An orchestrator from before notice keys gave none: its keepalives count unauthenticated, as before.
        self._keepalive_key = None if self._notice_key is None else keepalive_key(self._notice_key)
        self._keepalive_number = 0
        self._task: asyncio.Task | None = None

    @property
    def pipeline_id(self) -> str:
        return self.request.pipeline_id

    async def start(self) -> None:
        # The orphan clock starts when the hop listens: its open may have waited for the compute thread.
        self.last_heard = time.monotonic()
        await self.receiver.start()
        await self.sender.start()
        self._keepalive_sub = await self.nc.subscribe(keepalive_subject(self.pipeline_id), cb=self._on_keepalive)
        self._task = asyncio.create_task(self._serve(), name=f"hop-{self.pipeline_id}-{self.request.hop}")

    def expiry_reason(self, now: float) -> str | None:
        """Why the watchdog should close this hop now, or None (never while it is being opened)."""
        if self.open_settled.is_set() and now - self.last_heard > self.limits.orphan_timeout_s:
            return f"no step and no keepalive from its orchestrator for {now - self.last_heard:.1f} s"
        return None

    async def close(self, keep: PrefixBlocks | None = None) -> int:
        """Stop serving and free the session's cache, keeping the whole blocks of `keep` it holds as a prefix; the
        positions kept."""
        # Not only a cancel: on Python 3.11 a wait_for inside the serving loop can swallow a cancellation that
        # lands just as a step arrives. The flag and the closed receiver end the loop whatever it awaited.
        self.closed = True
        if self._keepalive_sub is not None:
            with contextlib.suppress(Exception):
                await self._keepalive_sub.unsubscribe()
        await self.receiver.close()
        await self.sender.close()
        task = self._task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                async with asyncio.timeout(self.limits.close_timeout_s):
                    await asyncio.shield(task)
        return await self.compute.end_session(self.request, keep, self.opener)

    async def keep_now(self, keep: PrefixBlocks) -> int:
        """Keep a copy of the session's whole blocks of `keep` while it goes on; the positions kept. One at a time: a
        keep asked while another runs keeps nothing (0), so a member's burst of them never queues on the compute
        thread ahead of every other member's steps."""
        if self._keeping:
            return 0
        self._keeping = True
        try:
            return await self.compute.keep_now(self.request, keep, self.opener)
        finally:
            self._keeping = False

    async def tell_dropped(self, message: str) -> None:
        """Tell the orchestrator that the step it may await here will not come, its session dropped (`message` says
        why): `session_evicted`, which blames nobody and has it re-open, answered as the shard answers that open."""
        if self._last_received is not None:
            await self._publish_notice(self._last_received, "session_evicted", message=message)

    async def _on_keepalive(self, msg: Msg) -> None:
        if self._keepalive_key is not None:
            # Only the opener's keepalive, and never one heard before: anyone may publish on this subject.
            number = keepalive_number(msg.data, msg.headers, self.request.hop, self._keepalive_key)
            if number is None or number <= self._keepalive_number:
                return
            self._keepalive_number = number
        self.last_heard = time.monotonic()

    async def _serve(self) -> None:
        request = self.request
        while not self.closed:
            try:
                received = await self.receiver.next_step(timeout_s=self.limits.idle_timeout_s)
            except TransportTimeout:
                continue  # the watchdog closes an idle hop
            except TransportClosed:
                return
            if self.closed:
                return
            self.last_heard = self.last_step = time.monotonic()
            if received.session != request.session_id:
                continue  # a frame of an earlier session of this pipeline (before a failover)
            self._last_received = received.step
            await self._run_step(received)

    async def _run_step(self, received: ReceivedStep) -> None:
        if received.kind is FrameKind.reset:
            # No orchestrator sends one: the hop before (which holds the link key) made it, to drop this session's
            # cache and have the next step fail here. Refused input, neither run nor passed on.
            await self._notify(received, "input_failed_check", check=refused_input_check,
                               message="input refused: a reset step (no orchestrator sends one)")
            return
        try:
            result = await self.compute.run(self.request, received, still_open=lambda: not self.closed,
                                            opener=self.opener)
        except SessionEvictedError as error:
            log.info("pipeline %s hop %d: step %d: %s", self.pipeline_id, self.request.hop, received.step, error)
            await self._notify(received, "session_evicted", message=str(error))
            return
        except SessionStateError as error:
            # The step's header does not continue the session's cache (a position past it, a session never
            # prefilled, a cache a reset step dropped): what the input declared, which the hop before may write as it
            # likes, not what this hop did. Reported as its input, as a refused frame is, so nobody is blamed.
            log.warning("pipeline %s hop %d: step %d does not continue its session: %s", self.pipeline_id,
                        self.request.hop, received.step, error)
            await self._notify(received, "input_failed_check", check=refused_input_check,
                               message=f"input refused: {_first_line(error)}")
            return
        except Exception as error:
            first_line = _first_line(error)
            log.warning("pipeline %s hop %d: step %d failed: %s: %s", self.pipeline_id, self.request.hop,
                        received.step, type(error).__name__, first_line)
            await self._notify(received, "step_failed", message=f"{type(error).__name__}: {first_line}")
            return
        if result.failed_check is not None:
            count_integrity_failure(result.failed_check, "hop_input")
            log.warning("pipeline %s hop %d: step %d input failed the %s check; dropped", self.pipeline_id,
                        self.request.hop, received.step, result.failed_check)
            await self._notify(received, "input_failed_check", check=result.failed_check)
            return
        sent = await self._pass_on(received, result.output)
        if sent is not None:
            self.compute.step_metrics.observe(received.kind.value, wire_s=received.wire_s,
                                              deserialize_s=received.decode_s, serialize_s=sent.encode_s,
                                              compute_s=result.compute_s)

    async def _pass_on(self, received: ReceivedStep, output):
        try:
            return await self.sender.send(received.info, output)
        except TransportError as error:
            # The next hop did not take it in: the orchestrator's stall watch finds out which hop is at fault.
            log.warning("pipeline %s hop %d: could not pass step %d on: %s", self.pipeline_id, self.request.hop,
                        received.step, error)
            return None

    async def _on_refused_input(self, header: FrameHeader, refusal: StepRefusal) -> None:
        """A step of this hop's session that does not fit the pipeline (empty, mis-shaped, another dtype or size):
        the hop before sent it, so the orchestrator hears it at once instead of waiting for the step to time out."""
        if header.session != self.request.session_id or header.step == self._last_refused_step:
            return  # another session's frame (none of ours to fail), or a further chunk of a step already reported
        self._last_refused_step = header.step
        log.warning("pipeline %s hop %d: step %d input refused: %s", self.pipeline_id, self.request.hop,
                    header.step, refusal.message)
        await self._publish_notice(header.step, "input_failed_check", check=refused_input_check,
                                   message=f"input refused: {refusal.message}")

    async def _notify(self, received: ReceivedStep, problem: HopProblem, *, check: str | None = None,
                      message: str = "") -> None:
        await self._publish_notice(received.step, problem, check=check, message=message)

    async def _publish_notice(self, step: int, problem: HopProblem, *, check: str | None = None,
                              message: str = "") -> None:
        notice = HopNotice(pipeline_id=self.pipeline_id, session_id=self.request.session_id, hop=self.request.hop,
                           step=step, problem=problem, check=check, message=message[:notice_message_chars])
        payload, headers = notice_message(notice, self._notice_key)
        try:
            await self.nc.publish(hop_notice_subject(self.pipeline_id), payload, headers=headers)
        except Exception as error:  # the broker is gone too: the orchestrator's stall watch takes over
            log.warning("pipeline %s hop %d: notice not sent: %s", self.pipeline_id, self.request.hop, error)


def _first_line(error: Exception) -> str:
    """An exception's first line, cut short: what a notice and the log say of it (never tensor contents)."""
    return (str(error).splitlines() or [""])[0][:300]


def opened_by(hop: ServedHop, request: OpenHop | CloseHop | KeepHop) -> bool:
    """Whether a request about an open hop comes from the orchestrator that opened it: a re-open repeats the open's
    owner key (OpenHop.owner_key), a close or keep proves it holds it (key_seal.py). A hop opened without one (an
    orchestrator from before owner keys) is anyone's, as before."""
    expected = hop.request.owner_key
    if expected is None or not isinstance(request, OpenHop):
        return expected is None or proves_owner(request, expected)
    return request.owner_key is not None and hmac.compare_digest(expected, request.owner_key)
