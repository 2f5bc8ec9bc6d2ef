"""Step executors: HopChain pumps one step through remote shard hops and watches for stalls and corruption;
LocalChain runs it on a whole local model (the fallback).

Who is to blame for a stalled step: the acks say which hop last took the step in (hop h), but not whether
h is slow or the hop after it never received h's output (it died, or is frozen with its connection still
open). So the chain probes hops h and h+1 with a `stat` control request: a hop that does not answer within
the probe's time (or has no responder at all) is the culprit; when both answer, h holds the step and is the
one to route around. The probe starts `probe_timeout_s` (at most half the step timeout) before the step
times out, so the verdict is there when it does: a stall is declared within the step timeout.

A host that died (killed, crashed, unplugged) need not wait that long: its NATS connection is gone, and
with it the subscription on its control subject, so a request there fails at once with "no responders".
Once a step has been held `gone_check_after_s` (far longer than a step normally takes, far shorter than
the step timeout), the chain asks the suspects once; one without a responder is failed over right away.
A frozen or merely slow host still has its connection and is left to the step timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
import uuid
from dataclasses import dataclass

import torch
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from inference import LocalModel
from services.common.compute import on_compute_thread
from services.common.control_protocol import (
    CloseHop,
    ControlReply,
    IntegrityNotice,
    OpenHop,
    ShardStat,
    StatShard,
    integrity_subject,
)
from services.orchestrator.router import Hop
from services.transport import (
    AckObserver,
    AckWindowSender,
    ActivationReceiver,
    FrameKind,
    StepInfo,
    TransportError,
    TransportTimeout,
    WaitInterrupted,
    wire_dtype_from_setting,
)
from services.transport.integrity import NormBounds, count_integrity_failure

log = logging.getLogger(__name__)

control_timeout_s = 5.0
# How often (a fraction of the step timeout) a waiting step looks at the acks for a hop holding it too long.
stall_poll_fraction = 0.1
# A live shard answers `stat` in milliseconds; one that has not within this is frozen or gone.
probe_timeout_s = 0.5
# "No responders" comes back at once; an answer slower than this is no evidence that the host is gone.
gone_check_timeout_s = 0.25
# What `[transport] gone_check_after_s` defaults to where no settings are given (tests, the library API).
default_gone_check_after_s = 0.5
close_flush_timeout_s = 2.0


class HopFailure(Exception):
    """A hop stalled, refused, or produced corrupted activations; `shard_id` is the one to route around."""

    def __init__(self, shard_id: str, reason: str, *, kind: str = "stalled", check: str | None = None) -> None:
        super().__init__(f"{shard_id}: {reason}")
        self.shard_id = shard_id
        self.reason = reason
        self.kind = kind  # stalled | refused | corrupt
        self.check = check


class ProbeOutcome(enum.Enum):
    answered = "answered"
    no_responder = "no_responder"  # nothing subscribes to its control subject: the host is gone
    silent = "silent"  # no answer in time: frozen, overloaded, or the answer was lost


class OpenRefused(HopFailure):
    def __init__(self, shard_id: str, code: str, message: str) -> None:
        super().__init__(shard_id, f"refused: {code}: {message}", kind="refused")
        self.code = code


@dataclass(frozen=True)
class StepTimeouts:
    step_timeout_s: float
    prefill_timeout_per_token_s: float = 0.01
    gone_check_after_s: float = default_gone_check_after_s

    def for_step(self, kind: FrameKind, tokens: int) -> float:
        if kind is FrameKind.prefill:
            return self.step_timeout_s + self.prefill_timeout_per_token_s * tokens
        return self.step_timeout_s


class HopChain:
    """One epoch of a pipeline: the opened hops, the sender into hop 0 and the sink after the last hop."""

    def __init__(
        self,
        nc: NatsClient,
        pipeline_id: str,
        hops: list[Hop],
        *,
        model_id: str,
        weights_sha256: str,
        timeouts: StepTimeouts,
        wire_dtype: str = "auto",
        window_chunks: int = 16,
        chunk_bytes: int | None = None,
        sink_bounds: NormBounds | None = None,
    ) -> None:
        self.nc = nc
        self.pipeline_id = pipeline_id
        self.hops = hops
        self.model_id = model_id
        self.weights_sha256 = weights_sha256
        self.timeouts = timeouts
        self.wire_dtype = wire_dtype
        self.session_id = uuid.uuid4().hex[:16]
        self.sink_bounds = sink_bounds or NormBounds()
        self._sender = AckWindowSender(nc, pipeline_id, 0, window_chunks=window_chunks,
                                       ack_timeout_s=timeouts.step_timeout_s, chunk_bytes=chunk_bytes,
                                       wire_dtype=wire_dtype_from_setting(wire_dtype))
        self._sink = ActivationReceiver(nc, pipeline_id, len(hops))
        self._observer = AckObserver(nc, pipeline_id, sink_hop=len(hops))
        self._integrity_sub = None
        self._notices: list[IntegrityNotice] = []
        self._open_sent = False
        # The liveness probe of the step currently held too long: (step, holder hop) and its task.
        self._probe_key: tuple[int, int] | None = None
        self._probe: asyncio.Task | None = None
        # The (step, holder hop) whose suspects were already checked for a lost connection.
        self._gone_checked: tuple[int, int] | None = None
        self._step = 0

    @property
    def shard_ids(self) -> list[str]:
        return [hop.shard_id for hop in self.hops]

    async def open(self) -> None:
        """Subscribe the sink first (so no output is lost), then open every hop; a refusal raises OpenRefused."""
        await self._sink.start()
        await self._observer.start()
        await self._sender.start()
        self._integrity_sub = await self.nc.subscribe(integrity_subject(self.pipeline_id), cb=self._on_notice)
        self._open_sent = True
        replies = await asyncio.gather(*(self._open_hop(i, hop) for i, hop in enumerate(self.hops)),
                                       return_exceptions=True)
        for hop, reply in zip(self.hops, replies):
            if isinstance(reply, BaseException):
                raise HopFailure(hop.shard_id, f"did not answer open: {reply!r}", kind="refused")
            if not reply.ok:
                raise OpenRefused(hop.shard_id, reply.code or "refused", reply.message)

    async def _open_hop(self, index: int, hop: Hop) -> ControlReply:
        request = OpenHop(
            pipeline_id=self.pipeline_id, session_id=self.session_id, hop=index, hop_count=len(self.hops),
            model_id=self.model_id, weights_sha256=self.weights_sha256, layer_lo=hop.layer_lo_to_run,
            layer_hi=hop.layer_hi_to_run, wire_dtype=self.wire_dtype,
        )
        message = await self.nc.request(hop.control_subject, request.model_dump_json().encode(),
                                        timeout=control_timeout_s)
        return ControlReply.model_validate_json(message.data)

    async def close(self) -> None:
        """Tell every hop asked to open to close this session (freeing its KV cache); drop the subscriptions.

        Closes are published without waiting for answers: a dead or frozen hop must not hold up a failover,
        and because each names this chain's session, a close that a shard reads late never closes a newer
        session of the same pipeline (the re-open after a failover reaches the shard after it anyway: one
        connection, one subject, so NATS keeps the order).
        """
        self._cancel_probe()
        # Every hop, not only those that confirmed: one whose answer to `open` timed out may still open late.
        hops = self.hops if self._open_sent else []
        self._open_sent = False
        request = CloseHop(pipeline_id=self.pipeline_id, session_id=self.session_id)
        for hop in hops:
            with contextlib.suppress(Exception):
                await self.nc.publish(hop.control_subject, request.model_dump_json().encode())
        if hops:
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=close_flush_timeout_s)
        for closer in (self._sender.close, self._sink.close, self._observer.close):
            with contextlib.suppress(Exception):
                await closer()
        if self._integrity_sub is not None:
            with contextlib.suppress(Exception):
                await self._integrity_sub.unsubscribe()
            self._integrity_sub = None

    async def _on_notice(self, msg: Msg) -> None:
        try:
            notice = IntegrityNotice.model_validate_json(msg.data)
        except Exception:
            return
        if notice.session_id == self.session_id:
            self._notices.append(notice)
            self._sink.interrupt_waiters()

    def _raise_for_notices(self) -> None:
        if self._notices:
            notice = self._notices[0]
            # Hop i saw corrupted input: hop i-1 produced it (hop 0's input comes from us).
            culprit = self.hops[max(notice.hop - 1, 0)]
            raise HopFailure(culprit.shard_id, f"hop {notice.hop} received activations failing the "
                             f"{notice.check} check", kind="corrupt", check=notice.check)

    async def step(self, kind: FrameKind, pos: int, hidden: torch.Tensor) -> torch.Tensor:
        """Send one step into hop 0 and return what leaves the last hop, or raise HopFailure."""
        self._step += 1
        self._cancel_probe()
        info = StepInfo(session=self.session_id, step=self._step, kind=kind, pos=pos)
        timeout_s = self.timeouts.for_step(kind, int(hidden.shape[1]))
        try:
            await self._sender.send(info, hidden)
        except TransportTimeout as error:
            raise HopFailure(self.hops[0].shard_id, f"hop 0 did not ack: {error}") from None
        sent_at = time.monotonic()
        poll_s = max(0.01, min(self.timeouts.step_timeout_s * stall_poll_fraction,
                               self.timeouts.gone_check_after_s / 2))
        while True:
            self._raise_for_notices()
            received = await self._next_output(poll_s)
            if received is None:
                await self._check_stall(info, sent_at, timeout_s)
                continue
            if received.session != self.session_id or received.step != self._step:
                continue
            self._raise_for_notices()
            failed_check = self.sink_bounds.check(received.tensor)
            if failed_check is not None:
                count_integrity_failure(failed_check, "sink")
                raise HopFailure(self.hops[-1].shard_id, f"output failed the {failed_check} check",
                                 kind="corrupt", check=failed_check)
            return received.tensor

    async def _next_output(self, wait_s: float):
        """The next step out of the last hop; None after `wait_s` or once an integrity notice arrives."""
        if self._notices:
            return None
        try:
            # Awaited directly (no helper tasks): on every token this is the orchestrator's critical path.
            return await self._sink.next_step(timeout_s=wait_s)
        except (TransportTimeout, WaitInterrupted):
            return None
        except TransportError as error:
            raise HopFailure(self.hops[-1].shard_id, f"sink failed: {error}") from None

    async def _check_stall(self, info: StepInfo, sent_at: float, timeout_s: float) -> None:
        progress = self._observer.progress(info.session, info.step)
        now = time.monotonic()
        if progress is None:
            holder, since = 0, sent_at
        else:
            # Acked by hop h: hop h holds it until hop h+1 acks. Acked by the sink hop: we are just slow.
            holder, since = progress.hop, progress.last_ack_monotonic
            if holder >= len(self.hops):
                return
        # Hop 0 never acked: nobody after it is involved. Otherwise the next hop may be the one gone.
        suspects = [i for i in ([holder] if progress is None else [holder, holder + 1]) if i < len(self.hops)]
        held_s = now - since
        if held_s > self.timeouts.gone_check_after_s and self._gone_checked != (info.step, holder):
            self._gone_checked = (info.step, holder)
            for index, outcome in zip(suspects, await self._probe_outcomes(suspects, gone_check_timeout_s)):
                if outcome is ProbeOutcome.no_responder:
                    raise HopFailure(self.hops[index].shard_id,
                                     f"no longer connected (no responder on its control subject); step "
                                     f"{info.step} held {held_s:.2f} s")
        probe_s = min(probe_timeout_s, self.timeouts.step_timeout_s / 2)
        if len(suspects) > 1 and held_s > timeout_s - probe_s and self._probe_key != (info.step, holder):
            self._cancel_probe()
            self._probe_key = (info.step, holder)
            self._probe = asyncio.create_task(self._probe_all(suspects, probe_s), name="hop-probe")
        if held_s > timeout_s:
            culprit = await self._blame(suspects)
            hop = self.hops[culprit]
            if culprit == holder:
                reason = f"step {info.step} not passed on within {timeout_s:.1f} s"
            else:
                reason = f"does not answer; step {info.step} not taken in within {timeout_s:.1f} s"
            raise HopFailure(hop.shard_id, reason)

    async def _blame(self, suspects: list[int]) -> int:
        """The first suspect hop that does not answer a probe; the first suspect when every one answers."""
        if len(suspects) == 1:
            return suspects[0]
        probe, self._probe, self._probe_key = self._probe, None, None
        answers = await (probe if probe is not None else self._probe_all(suspects, probe_timeout_s))
        for index, answered in zip(suspects, answers):
            if not answered:
                return index
        return suspects[0]

    async def _probe_all(self, suspects: list[int], timeout_s: float) -> list[bool]:
        outcomes = await self._probe_outcomes(suspects, timeout_s)
        return [outcome is ProbeOutcome.answered for outcome in outcomes]

    async def _probe_outcomes(self, suspects: list[int], timeout_s: float) -> list[ProbeOutcome]:
        return list(await asyncio.gather(*(self.probe_outcome(self.hops[i], timeout_s) for i in suspects)))

    def _cancel_probe(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        self._probe, self._probe_key = None, None

    async def probe_outcome(self, hop: Hop, timeout_s: float = probe_timeout_s) -> ProbeOutcome:
        """How the hop's shard reacts to `stat`: answers, has no responder (gone), or stays silent."""
        try:
            message = await self.nc.request(hop.control_subject, StatShard().model_dump_json().encode(),
                                            timeout=timeout_s)
            ShardStat.model_validate_json(message.data)
        except NoRespondersError:
            return ProbeOutcome.no_responder
        except Exception:  # a timeout, a closed connection, or an answer that is not a ShardStat
            return ProbeOutcome.silent
        return ProbeOutcome.answered


class LocalChain:
    """The same step interface over a whole model on this machine (local fallback)."""

    def __init__(self, local: LocalModel) -> None:
        self.local = local
        self.session_id = "local-" + uuid.uuid4().hex[:16]
        self.shard_ids: list[str] = []

    async def open(self) -> None:
        return None

    async def step(self, kind: FrameKind, pos: int, hidden: torch.Tensor) -> torch.Tensor:
        return await on_compute_thread(self.local.runner.forward, self.session_id, hidden, pos, kind.value)

    async def close(self) -> None:
        await on_compute_thread(self.local.runner.reset, self.session_id)
