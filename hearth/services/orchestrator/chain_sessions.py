"""HopSessions, mixed into HopChain: a chain's sessions on its hops over their control subjects: opening each hop
(the sink and the subscriptions first, so no output is lost; on a community mesh the `open` sealed and signed),
having them keep a prefix's blocks, telling them the pipeline lives, and closing them without waiting for answers."""

from __future__ import annotations

import asyncio
import contextlib
import time

from nats.errors import Error as NatsError, NoRespondersError

from hearth.events.cancellation import keeping_cancellation
from hearth.protocol.control import (
    CloseHop, ControlReply, KeepHop, OpenHop, PrefixBlocks, read_reply, reply_says_ok,
)
from hearth.protocol.subjects import hop_notice_subject, keepalive_subject
from hearth.services.broker.connection import flush_ordered
from hearth.services.orchestrator.hop_owner import open_message, owner_key, proven
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.orchestrator.prefix import behind_hops
from hearth.services.orchestrator.router import Hop
from hearth.services.transport.keepalives import telling_while
from hearth.services.transport.mac import encode_link_key


def _encoded(link_key: bytes | None) -> str | None:
    return encode_link_key(link_key) if link_key is not None else None


class HopSessions:
    """Mixed into HopChain: reads its hops, keys, placement, prefix, transport settings and connection, its sink,
    sender, observer, recorder and stall watch, and its `_on_notice` and `_broker_failure`."""

    async def open(self) -> StepFailure | None:
        """Subscribe the sink first (so no output is lost), then open every hop; the first hop that refused or
        did not answer (`broker`: our connection failed under the subscriptions), or None when all are open."""
        try:
            return await self._open()
        except BaseException:  # cancelled (the client left, a deadline, a shutdown): the caller never got it to close
            await asyncio.shield(self.close())
            raise

    async def _open(self) -> StepFailure | None:
        epoch = self.nc.stats["reconnects"]
        try:
            await self._sink.start()
            if self.recorder is not None:
                await self.recorder.start(self.session_id)
            await self._observer.start()
            await self._sender.start()
            self._notice_sub = await self.nc.subscribe(hop_notice_subject(self.pipeline_id), cb=self._on_notice)
        except NatsError as error:
            return self._broker_failure(epoch, "subscribing") or StepFailure("broker", None, f"subscribing: {error}")
        self._open_sent = True
        opening = asyncio.gather(*(self._open_hop(i, hop) for i, hop in enumerate(self.hops)), return_exceptions=True)
        # A re-open waits for its shard's compute thread: the hops that answered at once must not close as orphans.
        replies = await telling_while(opening, self.keep_alive, self.transport.keepalive_interval_s)
        for hop, reply in zip(self.hops, replies):
            if isinstance(reply, NoRespondersError):
                return StepFailure("gone", hop.shard_id, "no responder on its control subject")
            if isinstance(reply, BaseException):
                return self._broker_failure(epoch, "opening the pipeline") or StepFailure(
                    "refused", hop.shard_id, f"did not answer open: {reply!r}")
            if not reply.ok:
                return StepFailure("refused", hop.shard_id, f"refused: {reply.code or 'refused'}: {reply.message}",
                                   code=reply.code)
        if self.prefix is not None:  # a hop holds at most the blocks named, whatever it answers
            named_tokens = len(self.prefix.hashes) * self.prefix.block_tokens
            self.reused_tokens = self._prefill_start = min(named_tokens, *(reply.cached_tokens for reply in replies))
        self.replay_steps = all(reply.replay_steps for reply in replies)
        return None

    async def _open_hop(self, index: int, hop: Hop) -> ControlReply:
        # The hop refuses steps beyond the call's positions (without it, OpenHop's default bound).
        session_bound = {} if self.max_session_tokens is None else {"max_session_tokens": self.max_session_tokens}
        request = OpenHop(
            pipeline_id=self.pipeline_id, session_id=self.session_id,
            **self.placement.seen_by(self.hops, index, self.node_id),
            model_id=self.model_id, weights_sha256=self.weights_sha256, quantization=hop.quantization,
            layer_lo=hop.layer_lo_to_run, layer_hi=hop.layer_hi_to_run, wire_dtype=self.wire_dtype, **session_bound,
            inbound_link_key=_encoded(self.link_keys[index]),
            outbound_link_key=_encoded(self.link_keys[index + 1]),
            notice_key=encode_link_key(self.notice_keys[index]), seal_activations=self.sealed,
            prefix=behind_hops(self.prefix, self.hops, index),
            owner_key=owner_key(self.pipeline_id, hop.shard_id))
        sent = open_message(request, hop.node_id, hop.control_subject, self.sign_open)  # on a community mesh: sealed
        if isinstance(sent, ControlReply):
            return sent
        asked_at = time.perf_counter()
        message = await keeping_cancellation(self.nc.request(
            hop.control_subject, sent[0], timeout=self.transport.control_timeout_s, headers=sent[1]))
        if self.on_round_trip is not None:
            self.on_round_trip(hop.shard_id, time.perf_counter() - asked_at)
        return read_reply(message.data)

    async def keep_now(self, keep: PrefixBlocks) -> bool:
        """Have every hop keep a copy of its session's whole blocks of `keep` while it goes on; whether all did."""
        asks = [self.nc.request(hop.control_subject, proven(KeepHop(
            pipeline_id=self.pipeline_id, session_id=self.session_id, keep=behind_hops(keep, self.hops, index)),
            hop.shard_id).model_dump_json().encode(), timeout=self.transport.control_timeout_s)
            for index, hop in enumerate(self.hops)]
        replies = await asyncio.gather(*asks, return_exceptions=True)  # a hop gone: the others prefill the rest
        return all(not isinstance(r, BaseException) and reply_says_ok(r.data) for r in replies)

    async def keep_alive(self) -> None:
        """Tell the hops this pipeline's orchestrator is alive (hearth/services/shard/hops.py drops silent ones)."""
        with contextlib.suppress(Exception):  # MACed for each hop: transport/keepalives.py
            await self._keepalives.publish(self.nc, keepalive_subject(self.pipeline_id))

    async def close(self, keep: PrefixBlocks | None = None) -> None:
        """Tell every hop asked to open to close this session (freeing its KV cache, but for the blocks of `keep`
        it holds whole: hearth/services/orchestrator/prefix.py); drop the subscriptions.

        Closes are published without waiting for answers: a dead or frozen hop must not hold up a failover,
        and because each names this chain's session, a close that a shard reads late never closes a newer
        session of the same pipeline.
        """
        self._watch.cancel()
        # Every hop, not only those that confirmed: one whose answer to `open` timed out may still open late.
        hops = self.hops if self._open_sent else []
        self._open_sent = False
        for index, hop in enumerate(hops):
            request = proven(CloseHop(pipeline_id=self.pipeline_id, session_id=self.session_id,
                                      keep=behind_hops(keep, self.hops, index)), hop.shard_id)
            with contextlib.suppress(Exception):
                await self.nc.publish(hop.control_subject, request.model_dump_json().encode())
        if hops:
            with contextlib.suppress(Exception):
                await flush_ordered(self.nc, self.transport.control_timeout_s)
        closers = [self._sender.close, self._sink.close, self._observer.close]
        if self.recorder is not None:
            closers.append(self.recorder.close)
        for closer in closers:
            with contextlib.suppress(Exception):
                await closer()
        if self._notice_sub is not None:
            with contextlib.suppress(Exception):
                await self._notice_sub.unsubscribe()
            self._notice_sub = None
