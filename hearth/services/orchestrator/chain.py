"""HopChain: sends one step into remote shard hops and returns what leaves the last one, or a StepFailure saying which
hop failed and why (local_chain.py runs a step on a whole local model instead: the fallback). Its sessions on the
hops, opened, kept and closed over their control subjects, are chain_sessions.py.

A step fails (a typed result, never an exception) when:
- a hop tells us so at once on the pipeline's notice subject (with the MAC of the hop it names, notices.py): its
  layers raised (`step_failed`, that hop is to blame), its input failed an integrity check (`reported`: the hop
  before it is routed around for this call, blamed nowhere: the orchestrator cannot verify the report), or its
  session's KV cache was evicted (`evicted`: nobody is to blame; the caller re-prefills on the same chain);
- the output that reaches us fails the integrity check (`corrupt`, the last hop), or has another number of positions
  than the step sent (`corrupt`, the hop the taps saw change them; else `reported`: the last hop, blamed nowhere);
- the stall watch finds a hop gone or holding the step too long (`gone`, `stalled`; stall.py), or, before a step is
  sent, a hop's host is no longer a member (`gone`: its removal or key rotation is in the roster or the event log),
  so a call moves off a removed host at its next step even where a broker still admits that host;
- our connection to the broker was lost while the step was out, or could not take it (`broker`, nobody's shard is
  to blame).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from hearth.protocol.control import HopNotice, PrefixBlocks
from hearth.protocol.subjects import LinkNodes
from hearth.services.common.config import TransportSettings
from hearth.services.orchestrator.chain_sessions import HopSessions
from hearth.services.orchestrator.metrics import HopLatencies, hop_notices_refused_total
from hearth.services.orchestrator.hop_notices import notice_failure
from hearth.services.orchestrator.hop_owner import OpenSigner
from hearth.services.orchestrator.outcomes import StepFailure, output_failure
from hearth.services.orchestrator.placement import ChainPlacement
from hearth.services.orchestrator.recording import ChainRecorder
from hearth.services.orchestrator.router import Hop
from hearth.services.orchestrator.stall import HopHeld, StallWatch
from hearth.services.transport import (
    AckObserver, AckWindowSender, ActivationReceiver, FrameHeader, FrameKind, ReceivedStep, StepInfo, StepLimits,
    StepRefusal, TransportError, TransportTimeout, WaitInterrupted, receiver_settings, wire_dtype_from_setting,
)
from hearth.services.transport.integrity import NormBounds
from hearth.services.transport.keepalives import KeepaliveSender
from hearth.services.transport.mac import ack_witness_key, new_link_key
from hearth.services.transport.notices import read_notice

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SentStep:
    """A step sent into hop 0 whose output has not been awaited yet (several may be out: chunked prefill)."""

    info: StepInfo
    sent_at: float
    timeout_s: float
    queued_behind: bool  # steps sent before it were still out: its hop latencies include queueing, not observed
    epoch: int  # our reconnect count when it was sent: what the hops answered across a later reconnect is lost
    tokens: int  # its positions: its output has as many


class HopChain(HopSessions):
    """One epoch of a pipeline: the opened hops, the sender into hop 0 and the sink after the last hop."""

    def __init__(self, nc: NatsClient, pipeline_id: str, hops: list[Hop], *, node_id: str, model_id: str,
                 weights_sha256: str, transport: TransportSettings, wire_dtype: str = "auto",
                 sink_bounds: NormBounds | None = None, hidden_size: int | None = None,
                 max_session_tokens: int | None = None, on_round_trip: Callable[[str, float], None] | None = None,
                 accusers: set[str] | None = None, record_budget_bytes: int | None = None,
                 placement: ChainPlacement | None = None, prefix: PrefixBlocks | None = None,
                 sign_open: OpenSigner | None = None,
                 why_not_a_member: Callable[[str], str | None] | None = None) -> None:
        self.nc, self.sign_open = nc, sign_open  # seals and signs each `open` on a community mesh (hop_owner.py)
        # Why a hop's host may no longer serve (ShardRouter.why_not_a_member), asked before each step; None: never.
        self.why_not_a_member = why_not_a_member
        # The blocks its hops may start from (hearth/services/orchestrator/prefix.py) and the positions every hop holds
        # of them once opened: where the chain's first prefill starts; whether every hop takes `replay` steps.
        self.prefix = prefix
        self.reused_tokens = self._prefill_start = 0
        self.replay_steps = False
        # Where these hops sit in the pipeline as their hosts are told (a mirror's or a canary's single hop looks
        # like that hop of a real call); by default the whole pipeline, between this orchestrator's two ends.
        self.placement = placement or ChainPlacement()
        first, upstream = self.placement.first_hop, self.placement.upstream_node or node_id
        downstream = self.placement.downstream_node or node_id
        # The call's shards that reported bad input before (shared by its chains): one that reports again is the
        # common factor of its reports, and is routed around itself. Told (shard_id, seconds) for every hop that
        # answered `open`: routing's measured round trip.
        self.accusers, self.on_round_trip = set() if accusers is None else accusers, on_round_trip
        self.node_id, self.pipeline_id, self.hops, self.model_id = node_id, pipeline_id, hops, model_id
        self.weights_sha256, self.transport, self.wire_dtype = weights_sha256, transport, wire_dtype
        self.session_id = uuid.uuid4().hex[:16]
        # One fresh MAC key per link (into hop i; the last into our sink), told only to the link's two ends.
        self.link_keys = [new_link_key() if transport.activation_macs else None for _ in range(len(hops) + 1)]
        # Sealed links encrypt frames end to end with keys derived from those (no link keys, nothing to seal with).
        self.sealed = transport.seal_activations and transport.activation_macs
        # And one per hop for its notices, told to that hop alone: a notice can speak only for its sender's hop.
        self.notice_keys = [new_link_key() for _ in hops]
        # Indexed by the hop a notice names; keys nobody was told stand for the hops before these.
        self._notice_keys_by_hop = [new_link_key() for _ in range(first)] + self.notice_keys
        self._keepalives = KeepaliveSender(first, self.notice_keys)
        self.sink_bounds = sink_bounds or NormBounds()
        self._sender = AckWindowSender(nc, pipeline_id, first, nodes=LinkNodes(sender=upstream,
                                                                               receiver=hops[0].node_id),
                                       link_key=self.link_keys[0], seal=self.sealed,
                                       window_chunks=transport.window_chunks,
                                       ack_timeout_s=transport.step_timeout_s, chunk_bytes=transport.chunk_bytes,
                                       wire_dtype=wire_dtype_from_setting(wire_dtype))
        # Every hop and the sink know what a step of this call can be: [1, tokens, hidden] within its positions.
        self.max_session_tokens = max_session_tokens
        step_limits = None
        if hidden_size is not None and max_session_tokens is not None:
            step_limits = StepLimits.for_pipeline(hidden_size=hidden_size, max_tokens=max_session_tokens,
                                                  activation_dtype=wire_dtype)
        # What every hop received and sent, for checks on other replicas (hearth/services/orchestrator/recording.py).
        self.recorder = ChainRecorder(nc, pipeline_id, [hop.node_id for hop in hops], link_keys=self.link_keys,
                                      sealed=self.sealed, step_limits=step_limits, transport=transport,
                                      budget_bytes=record_budget_bytes) if record_budget_bytes else None
        # Each hop's acks (and our sink's) carry a witness only it can make (transport/mac.py): no hop acks for another.
        witness_keys = dict(enumerate((ack_witness_key(key) for key in [*self.notice_keys, new_link_key()]), first))
        self._sink = ActivationReceiver(nc, pipeline_id, first + len(hops),
                                        nodes=LinkNodes(sender=hops[-1].node_id, receiver=downstream),
                                        step_limits=step_limits, on_refused=self._on_refused_output,
                                        link_key=self.link_keys[len(hops)], seal=self.sealed, **receiver_settings(
                                            transport), ack_witness_key=witness_keys[first + len(hops)])
        self._refused_output: StepFailure | None = None
        macs = transport.activation_macs
        self._observer = AckObserver(nc, pipeline_id, sink_hop=first + len(hops), ack_witness_keys=witness_keys
                                     if macs else None, link_keys=dict(enumerate(self.link_keys, start=first))
                                     if macs else None, tracked=lambda session, step: session == self.session_id
                                     and step in self._outstanding, max_chunks_per_step=step_limits and
                                     step_limits.max_chunks)
        self._watch = StallWatch(nc, hops, self._observer, transport, first_hop=first, pipeline_id=pipeline_id)
        self._latencies = HopLatencies(self.shard_ids)
        self._notice_sub = None
        self._notices: list[HopNotice] = []
        self._open_sent, self._step = False, 0
        # Steps sent whose outputs were not awaited yet, and outputs that came before the one awaited.
        self._outstanding: set[int] = set()
        self._early: dict[int, ReceivedStep] = {}

    @property
    def shard_ids(self) -> list[str]:
        return [hop.shard_id for hop in self.hops]

    def take_reused_tokens(self) -> int:
        """Where the chain's first prefill starts (its hops hold the positions before); 0 for every later one (a
        re-prefill after an eviction starts over)."""
        reused, self._prefill_start = self._prefill_start, 0
        return reused

    async def _on_notice(self, msg: Msg) -> None:
        notice = read_notice(msg.data, msg.headers, pipeline_id=self.pipeline_id, session_id=self.session_id,
                             notice_keys=self._notice_keys_by_hop)
        if isinstance(notice, str):
            hop_notices_refused_total.labels(notice).inc()
            log.debug("pipeline %s: dropped a hop notice (%s)", self.pipeline_id, notice)
            return
        # Only steps out now: a late notice of an earlier step (one re-prefilled since) is stale.
        if notice is not None and notice.step in self._outstanding and notice.hop >= self.placement.first_hop:
            # Kept by the index of the hop among these.
            self._notices.append(notice.model_copy(update={"hop": notice.hop - self.placement.first_hop}))
            self._sink.interrupt_waiters()

    async def _on_refused_output(self, header: FrameHeader, refusal: StepRefusal) -> None:
        """The last hop sent a step of this chain's session that does not fit the pipeline (empty, mis-shaped,
        another dtype or size): the step fails at once, blaming it, instead of waiting for a timeout."""
        if header.session == self.session_id and header.step in self._outstanding and self._refused_output is None:
            self._refused_output = StepFailure("corrupt", self.hops[-1].shard_id,
                                               f"its output of step {header.step} was refused: {refusal.message}",
                                               check="shape")
            self._sink.interrupt_waiters()

    def _notice_failure(self) -> StepFailure:
        notice = self._notices[0]
        self._notices.clear()  # the chain stays usable: an evicted session is re-prefilled on the same hops
        return notice_failure(notice, self.hops, self.accusers)

    def _broker_failure(self, epoch: int, doing: str) -> StepFailure | None:
        """A failure blaming the broker when our connection dropped since `epoch` (a reconnect count)."""
        if self.nc.is_connected and self.nc.stats["reconnects"] == epoch:
            return None
        url = self.nc.connected_url or next(iter(self.nc.servers), None)
        where = url.netloc if url is not None else "(unknown address)"
        return StepFailure("broker", None, f"the connection to the NATS broker at {where} was lost while {doing}")

    def _step_timeout_s(self, kind: FrameKind, tokens: int) -> float:
        per_token_s = 0.0 if kind is FrameKind.decode else self.transport.prefill_timeout_per_token_s
        return self.transport.step_timeout_s + per_token_s * tokens

    async def step(self, kind: FrameKind, pos: int, hidden: torch.Tensor,
                   prompt_tokens: int | None = None) -> torch.Tensor | StepFailure:
        """Send one step into hop 0; what leaves the last hop, or why it will not."""
        sent = await self.send_step(kind, pos, hidden, prompt_tokens=prompt_tokens)
        return sent if isinstance(sent, StepFailure) else await self.await_step(sent)

    async def send_step(self, kind: FrameKind, pos: int, hidden: torch.Tensor, *,
                        queued_tokens: int = 0, prompt_tokens: int | None = None) -> SentStep | StepFailure:
        """Publish one step into hop 0 without waiting for its output (await_step it, in sending order).

        `queued_tokens`: prefill tokens of steps still out ahead of it, which every hop runs first, so its
        timeout grows by their share too. `prompt_tokens`: a prefill chunk's prompt length (Hearth-Prompt-Tokens)."""
        removed = self._removed_hop()
        if removed is not None:
            self._forget_outstanding()
            return removed
        self._step += 1
        info = StepInfo(session=self.session_id, step=self._step, kind=kind, pos=pos, prompt_tokens=prompt_tokens)
        timeout_s = self._step_timeout_s(kind, int(hidden.shape[1]) + queued_tokens)
        epoch, queued_behind = self.nc.stats["reconnects"], bool(self._outstanding)
        self._outstanding.add(self._step)
        if self.recorder is not None:
            self.recorder.sent(info, hidden)
        try:
            await self._sender.send(info, hidden, while_waiting=self._watch.window_check(info, time.monotonic(),
                                                                                        timeout_s))
            self._latencies.step_sent(kind)
        except HopHeld as held:  # hop 0 gone (or our own link cut) while the step waited for window space
            self._forget_outstanding()
            return held.failure
        except TransportTimeout as error:
            self._forget_outstanding()
            return self._broker_failure(epoch, f"step {self._step} was out") or StepFailure(
                "stalled", self.hops[0].shard_id, f"hop 0 did not ack: {error}")
        except TransportError as error:  # the publish failed (reconnect buffer full, connection closed): no hop's fault
            self._forget_outstanding()
            return self._broker_failure(epoch, f"step {self._step} was sent") or StepFailure(
                "broker", None, f"step {self._step} could not be published: {error}")
        return SentStep(info, time.monotonic(), timeout_s, queued_behind, epoch, int(hidden.shape[1]))

    def _removed_hop(self) -> StepFailure | None:
        """The first hop whose host is no longer a member, failed as a host that died (`gone`): a broker that still
        admits it (another broker, an older roster) would let it go on computing, and seeing, this call's steps."""
        for hop in self.hops if self.why_not_a_member is not None else ():
            reason = self.why_not_a_member(hop.node_id)
            if reason is not None:
                return StepFailure("gone", hop.shard_id, f"its host {hop.node_id} may not serve: {reason}")
        return None

    def _forget_outstanding(self) -> None:
        """After a failure every step still out is abandoned: its late notices and outputs are stale."""
        self._outstanding.clear()
        self._early.clear()

    async def await_step(self, sent: SentStep) -> torch.Tensor | StepFailure:
        """The output of a step sent earlier (the oldest still out), or why it will not come."""
        result = await self._await_output(sent)
        if isinstance(result, StepFailure):
            self._forget_outstanding()
        else:
            self._outstanding.discard(sent.info.step)
            if self.recorder is not None:
                self.recorder.completed(sent.info, result)
        return result

    async def _await_output(self, sent: SentStep) -> torch.Tensor | StepFailure:
        info, epoch, doing = sent.info, sent.epoch, f"step {sent.info.step} was out"
        self._watch.cancel()
        while True:
            if self._notices:
                return self._notice_failure()
            if self._refused_output is not None:
                return self._refused_output
            received = self._early.pop(info.step, None) or await self._next_output(self._watch.poll_s)
            if isinstance(received, StepFailure):
                return received
            ours = received is not None and received.session == self.session_id and received.step in self._outstanding
            if ours and received.step != info.step:
                self._early[received.step] = received  # a later step out: kept until it is awaited
            if not ours or received.step != info.step:
                # Nothing yet, or another step's output: the watch looks either way (a last hop may send those forever).
                failure = self._broker_failure(epoch, doing) or await self._watch.check(info, sent.sent_at,
                                                                                       sent.timeout_s)
                if failure is not None:
                    return failure
                continue
            if self._notices:
                return self._notice_failure()
            failure = output_failure(received.tensor, info.step, sent.tokens, self.shard_ids, self.sink_bounds,
                                     self.recorder and self.recorder.resized_by)
            if failure is not None:
                return failure
            progress = self._observer.progress(self.session_id, info.step)
            self._latencies.output_reached(None if progress is None or sent.queued_behind else progress.first_ack_at)
            return received.tensor

    async def _next_output(self, wait_s: float):
        """The next step out of the last hop; None after `wait_s` or once a hop notice or a refusal arrives."""
        if self._notices or self._refused_output is not None:
            return None
        try:
            # Awaited directly (no helper tasks): on every token this is the orchestrator's critical path.
            return await self._sink.next_step(timeout_s=wait_s)
        except (TransportTimeout, WaitInterrupted):
            return None
        except TransportError as error:
            return StepFailure("stalled", self.hops[-1].shard_id, f"sink failed: {error}")
