"""ShardServer: hosts one layer range, advertises and heartbeats it, answers its control subject (open, close, stat)
and keeps the hops it serves (hearth/services/shard/hops.py), closing those whose orchestrator went silent
(hearth/services/shard/watchdog.py).

Control requests are answered concurrently, each in a task of its own: a liveness probe (`stat`) must not wait behind
an `open` or `close` that waits for a long prefill, and `stat` itself never touches the runner (ShardCompute keeps a
snapshot of its cache figures); one opener has at most max_concurrent_streams opens in progress (opens_in_flight.py).
Opens and closes still take effect in the order they arrived (one lock, acquired in arrival order), so a late close
never overtakes the re-open after a failover; but neither waits for the compute thread under that lock: an `open`
reserves its hop under it and attaches its kept prefix (or resets the hop it replaces) outside it, and a `close`
closes outside it what it detached under it (hearth/services/shard/hop_closing.py). Until it knows it keeps its
shard id (hearth/services/shard/claim.py) it
answers the claims it outranks at once and holds every other request until then; a process that gave way, then or
later, answers nothing and withdraws nothing. Once withdrawn (a `hearth host` moving: `withdraw`, then `drain`) it opens
no new pipeline and lets the calls open here end before it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from pathlib import Path

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from hearth.events.models import ShardWithdrawn, default_hop_weight
from hearth.events.publish import publish_event
from hearth.events.streams import SHARDS_STREAM, ensure_streams
from hearth.services.common.config import HearthSettings
from hearth.protocol.control import (
    CloseHop,
    ControlReply,
    KeepHop,
    OpenHop,
    ShardStat,
    StatShard,
)
from hearth.services.common.event_trust import (
    event_signing_key,
    open_verifier,
    steward_keys_from_the_log,
    stream_setup,
)
from hearth.services.common.lifecycle import event_within, owned_task
from hearth.services.broker.connection import flush_ordered
from hearth.services.broker.permissions import reply_allowed
from hearth.services.shard.admission import admission_refusal
from hearth.services.shard.claim import ClaimQuestion, ShardClaim, taken, unless_taken
from hearth.services.shard.compute import ShardCompute
from hearth.services.shard.hop_closing import HopClosing
from hearth.services.shard.hops import HopLimits, ServedHop, opened_by
from hearth.services.shard.identity import ShardIdentity, advertisement, open_refusal
from hearth.services.shard.kept_events import say_once, shard_outbox, start_outbox
from hearth.services.shard.open_check import checked_open, decoded_control_request
from hearth.services.shard.opens_in_flight import OpensInFlight
from hearth.services.shard.watchdog import watch_hops

log = logging.getLogger(__name__)

# How often a draining shard looks whether its last hop has closed.
drain_poll_s = 0.1


class ShardServer(HopClosing):
    """Serves `open`/`close`/`stat` on its control subject and runs each open hop through ShardCompute."""

    def __init__(self, nc: NatsClient, compute: ShardCompute, identity: ShardIdentity, settings: HearthSettings, *,
                 hop_weight: float = default_hop_weight, outbox_dir: Path | None = None) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.compute = compute
        self.identity = identity
        self.settings = settings.shard
        self.control_timeout_s = settings.transport.control_timeout_s
        self.probe_timeout_s = settings.transport.probe_timeout_s
        # A host configured to seal refuses to be opened in clear on links that carry keys (security by default).
        self.requires_sealing = settings.transport.seal_activations
        self.hop_weight = hop_weight
        # This host's member key signs its advertisements, heartbeats and withdrawals (None on an open mesh).
        self.signing_key = event_signing_key(settings.nats)
        # What it says once (its withdrawal) is kept in a file in `outbox_dir` until stored (None: in memory only).
        self.outbox = shard_outbox(nc, self.signing_key)
        self.outbox_dir = outbox_dir
        # On a community broker the steward creates the streams; on an open one this host does.
        self.stream_setup = stream_setup(settings.nats)
        # On a community mesh, who signed each `open`: one orchestrator holds at most its share of the hops here.
        # The steward's key as the shards stream's log rotates it counts for opens too (a shard reads that stream),
        # kept beside its outbox past the stream's retention.
        self.steward_keys = steward_keys_from_the_log(settings, self.js, (SHARDS_STREAM,), outbox_dir)
        self.open_verifier = open_verifier(settings, self.steward_keys)
        self._opens = OpensInFlight(settings.shard.max_concurrent_streams)  # each opener's, in progress at once
        self.limits = HopLimits(
            idle_timeout_s=settings.shard.eviction_idle_s,
            orphan_timeout_s=settings.transport.orphan_timeout_s, close_timeout_s=settings.shard.hop_close_timeout_s,
            transport=settings.transport)
        self._hops: dict[str, ServedHop] = {}
        self._hop_opened = asyncio.Event()  # wakes the watchdog, which waits for one while none is open
        self._control_sub = None
        self._background: list[asyncio.Task] = []
        self._control_tasks: set[asyncio.Task] = set()
        self._readvertise = asyncio.Event()
        self._hop_changes = asyncio.Lock()
        self._stopped = False
        self._withdrawn = False  # it said it leaves (withdraw): no new pipeline opens here, no advertisement follows
        self._claim = ShardClaim(self.signing_key)
        self._removal_tasks: set[asyncio.Task] = set()
        if self.steward_keys is not None:  # a removal read from the log drops what its key's opens left here
            self.steward_keys.retirement_listeners.append(lambda removal: owned_task(
                self._removal_tasks, self._drop_retired_opener(removal), name="shard-drop-removed"))
        self._question = ClaimQuestion(nc, identity.control_subject, self._claim)

    @property
    def active_streams(self) -> int:
        return len(self._hops)

    async def start(self) -> None:
        await self.stream_setup.ready(self.js, (SHARDS_STREAM,))
        if self.steward_keys is not None:
            await self.steward_keys.start()
        # What the node's previous shard host left (a withdrawal the broker never took) goes before any advertisement.
        await start_outbox(self.outbox, self.outbox_dir, self.identity.node_id, self.settings.withdraw_timeout_s)
        # One id, one process (hearth/services/shard/claim.py): listening first, then asking who else answers.
        self._control_sub = await self.nc.subscribe(self.identity.control_subject, cb=self._on_control)
        await flush_ordered(self.nc, self.control_timeout_s)
        await self._question.ask()
        await asyncio.sleep(self.probe_timeout_s)
        if not self._claim.decide():
            with contextlib.suppress(Exception):
                await self._control_sub.unsubscribe()
            await self._question.close()
            await self.outbox.stop(0.0)  # this process says nothing more; what is kept waits for the next
            raise taken(self.identity.shard_id)
        await self.advertise()
        self._background = [
            asyncio.create_task(self._heartbeat_loop(), name="shard-heartbeat"),
            asyncio.create_task(self._advertise_loop(), name="shard-advertise"),
            asyncio.create_task(self._watchdog_loop(), name="shard-hop-watchdog"),
        ]
        log.info("shard %s serving layers %d-%d on %s", self.identity.shard_id, self.identity.layer_lo,
                 self.identity.layer_hi, self.identity.control_subject)

    async def serve_until(self, ended: Awaitable[None]) -> None:
        """Await `ended` (the process's stop), unless this process gives way to another under its id first: `taken`."""
        await unless_taken(ended, self._claim, self.identity.shard_id)

    def request_readvertise(self) -> None:
        """Called after a reconnect: a restarted broker may have lost nothing, but routing must see us at once."""
        self._readvertise.set()

    async def advertise(self) -> None:
        await publish_event(self.js, advertisement(self.identity, self.settings, self.hop_weight),
                            signing_key=self.signing_key)

    async def heartbeat(self, *, retry_log_level: int = logging.WARNING) -> None:
        stats = self.compute.stats
        queue_depth = stats.steps_in_compute + sum(h.receiver.ready_steps for h in self._hops.values())
        await publish_event(self.js, stats.heartbeat(self.identity.node_id, self.identity.shard_id,
                                                     queue_depth=queue_depth, active_streams=self.active_streams),
                            signing_key=self.signing_key, retry_log_level=retry_log_level)

    async def _heartbeat_loop(self) -> None:
        missed = 0  # heartbeats not published in a row: one WARNING for the run of them, not one each
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            if not self._claim.kept:  # it gave way: the id is another process's
                return
            try:
                await self.heartbeat(retry_log_level=logging.DEBUG if missed else logging.WARNING)
            except Exception as error:  # the broker may be restarting (or its store full); the next beat tries again
                missed += 1
                (log.warning if missed == 1 else log.debug)(
                    "heartbeat not published: %s; the next ones are tried, said again once one is", error)
                continue
            if missed:
                log.info("heartbeat published again after %d missed", missed)
                missed = 0

    async def _advertise_loop(self) -> None:
        # Re-advertise well inside the TTL so the advertisement never expires while we are alive.
        while True:
            await event_within(self._readvertise, self.settings.advertisement_ttl_s / 3)  # a stop is never lost
            reconnected = self._readvertise.is_set()
            self._readvertise.clear()
            if not self._claim.kept or self._withdrawn:  # it gave way (the id is another process's), or it leaves
                return
            try:
                if reconnected:  # claims sent while this process was cut off never reached it: ask again
                    await self._question.ask()
                if self.stream_setup.create:
                    await ensure_streams(self.js)
                await self.advertise()
            except Exception as error:
                log.warning("advertisement not published: %s", error)

    async def _watchdog_loop(self) -> None:
        kept_idle_s = self.settings.prefix_cache_idle_s or self.settings.eviction_idle_s  # 0: nothing is kept
        await watch_hops(self._hops, self.limits, self.compute.evict_idle, self._close_expired,
                         hop_opened=self._hop_opened, cache_idle_s=min(self.settings.eviction_idle_s, kept_idle_s))

    async def stop(self, reason: str = "shutdown") -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._control_sub is not None:  # first: a request heard after its tasks were cancelled would run on
            with contextlib.suppress(Exception):
                await self._control_sub.unsubscribe()
        tasks = [*self._background, *self._control_tasks, *self._removal_tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._question.close()
        if self.steward_keys is not None:
            await self.steward_keys.stop()
        for pipeline_id in list(self._hops):
            await self._close_hop(pipeline_id)
        await self.withdraw(reason)
        await self.outbox.stop(0.0)  # the withdrawal had its wait: what is left is kept in the file

    async def withdraw(self, reason: str) -> None:
        """Say once that this shard leaves (routing stops choosing it); from then on it opens no new pipeline and
        advertises no more, while the hops open go on until they close or stop() closes them. Nothing when the id
        is another process's (or was never claimed): its withdrawal is not ours."""
        if self._withdrawn or not self._claim.kept:
            return
        self._withdrawn = True
        # Said once (advertisements are sent again, it is not): kept in the outbox until stored, across an outage.
        if not await say_once(self.outbox, ShardWithdrawn(node_id=self.identity.node_id,
                                                          shard_id=self.identity.shard_id, reason=reason),
                              self.settings.withdraw_timeout_s):
            log.warning("withdrawal of %s not stored (in %.1f s, or the broker refuses this host's key): kept in the "
                        "event outbox for the broker", self.identity.shard_id, self.settings.withdraw_timeout_s)

    async def drain(self, timeout_s: float, interrupted: asyncio.Event) -> None:
        """Withdrawn, wait until the orchestrators have closed every hop open here (their calls ended) and had their
        answers (stop() cancels the requests still being answered), `timeout_s` passed or `interrupted` is set; the
        watchdog still closes the hops of orchestrators gone silent."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while (self._hops or self._control_tasks) and not await event_within(interrupted, drain_poll_s):
                    pass

    # ---------------------------------------------------------------- control

    async def _on_control(self, msg: Msg) -> None:
        # nats-py runs one subscription's callbacks one after another: answer each request in its own task.
        owned_task(self._control_tasks, self._answer_control(msg), name="shard-control")

    async def _answer_control(self, msg: Msg) -> None:
        if self._claim.kept is False:  # another process keeps this id: it answers
            return
        request = decoded_control_request(msg.data)
        if isinstance(request, ControlReply):  # refused as it is read
            await self._reply(msg, request)
            return
        if isinstance(request, StatShard) and request.claim is not None and self._claim.from_this_node(msg):
            # Another process under this id: answered at once when this one outranks it (it then gives way), else this
            # one gives way and answers nothing. A claim not of this node is a plain `stat`.
            if self._claim.hear_claim(request):
                await self._reply(msg, self.stat(answering_claim=True))
            return
        if not await self._claim.settle(self.control_timeout_s):
            return
        if isinstance(request, StatShard):
            await self._reply(msg, self.stat())
        elif isinstance(request, KeepHop):
            hop = self._hops.get(request.pipeline_id)
            if (hop is None or not hop.open_settled.is_set() or hop.request.session_id != request.session_id
                    or not opened_by(hop, request)):
                await self._reply(msg, ControlReply(ok=False, code="unknown_pipeline",
                                                    message="no such session open here"))
            else:
                kept = 0 if self._retired(hop.opener_key) else await hop.keep_now(request.keep)
                await self._reply(msg, ControlReply(ok=True, cached_tokens=kept))
        elif isinstance(request, CloseHop):
            # Detached under the lock, closed outside it: closing waits for the compute thread (the session's
            # cache reset queues behind the step in progress there), and an `open` of another pipeline must not
            # wait for that (it would be refused as `shard_unavailable` once control_timeout_s passed).
            async with self._hop_changes:
                hop = self._hops.get(request.pipeline_id)
                # A close naming an older session (sent before a failover re-opened this pipeline) is stale.
                if (hop is not None and request.session_id in (None, hop.request.session_id)
                        and opened_by(hop, request)):
                    hop = self._detach_hop(request.pipeline_id)
                else:
                    hop = None
            if hop is not None:
                await self._finish_closing(request.pipeline_id, hop, request.keep)
            await self._reply(msg, ControlReply(ok=True))
        else:
            opened = checked_open(msg, request, self.open_verifier, self.signing_key)
            reply = opened if isinstance(opened, ControlReply) else await self._opens.answer(
                opened[0], lambda: self._open_hop(opened[2], opened[0], opened[1]))
            await self._reply(msg, reply)

    async def _reply(self, msg: Msg, reply: ControlReply | ShardStat) -> None:
        # Only into an inbox: an answer elsewhere (an event or API subject) would act with this host's rights.
        if msg.reply and not reply_allowed(msg.reply):
            log.warning("control request on %s dropped: its reply subject is not an inbox", msg.subject)
        elif msg.reply:
            reply.shard_id = self.identity.shard_id
            with contextlib.suppress(Exception):  # the asker or the broker is gone: nobody to tell
                await msg.respond(reply.model_dump_json().encode())

    def stat(self, answering_claim: bool = False) -> ShardStat:
        """What this shard holds now (answers `stat`: the orchestrator's liveness probe); its claim, to another's."""
        cache = self.compute.cache
        return ShardStat(shard_id=self.identity.shard_id, active_streams=self.active_streams,
                         open_pipelines=sorted(self._hops), cached_sessions=cache.sessions,
                         cache_bytes=cache.cache_bytes, **(self._claim.answer_fields() if answering_claim else {}))

    async def _open_hop(self, request: OpenHop, opener: str | None = None,
                        opener_key: str | None = None) -> ControlReply:
        """Reserve the hop under `_hop_changes`, wait for the compute thread (the replaced hop's reset, the kept prefix)
        outside it, then start the hop under it again: an open waiting behind a long step holds up no other open or
        close. Whoever detaches a hop closes it, once its open has settled (`_finish_closing`)."""
        refusal = open_refusal(request, self.identity, self.compute.runner.info.max_positions, self.requires_sealing)
        if refusal is not None:
            return refusal
        async with self._hop_changes:
            reserved = self._reserve_hop(request, opener, opener_key)
        if isinstance(reserved, ControlReply):
            return reserved
        hop, replaced = reserved
        failure: Exception | None = None
        try:
            cached = await self._bring_up(request, hop, replaced)
        except Exception as error:  # the broker or the compute thread failed us: no half-open hop stays behind
            failure = error
        finally:
            hop.open_settled.set()
        if failure is not None:
            log.warning("could not open hop %d of pipeline %s: %s", request.hop, request.pipeline_id,
                        type(failure).__name__)
            async with self._hop_changes:
                ours = self._hops.get(request.pipeline_id) is hop
                if ours:
                    self._detach_hop(request.pipeline_id)
            if ours:  # else whoever detached it closes it
                with contextlib.suppress(Exception):
                    await self._finish_closing(request.pipeline_id, hop)
            return ControlReply(ok=False, code="bad_request",
                                message=f"could not open the hop: {type(failure).__name__}")
        if cached is None:
            return ControlReply(ok=False, code="unknown_pipeline", message="the hop was closed before its open ended")
        log.info("opened hop %d of pipeline %s (layers %d-%d, %d positions kept from earlier)", request.hop,
                 request.pipeline_id, request.layer_lo, request.layer_hi, cached)
        return ControlReply(ok=True, cached_tokens=cached, replay_steps=True)

    def _reserve_hop(self, request: OpenHop, opener: str | None,
                     opener_key: str | None = None) -> ControlReply | tuple[ServedHop, ServedHop | None]:
        """Under `_hop_changes`: the new hop, counted as open, and the hop of its pipeline it replaces, detached."""
        if self._retired(opener_key):  # read since its signature was checked: its hops were dropped, this one too
            return ControlReply(ok=False, code="unauthorized", message="the open's key was removed from this community "
                                                                       "(its removal or rotation is in the event log)")
        replaced = self._hops.get(request.pipeline_id)
        if replaced is not None and not opened_by(replaced, request):
            return ControlReply(ok=False, code="pipeline_taken",
                                message=f"pipeline {request.pipeline_id} is open here for another orchestrator")
        if replaced is None and self._withdrawn:  # a re-open goes on with a call already here (its failover)
            return ControlReply(ok=False, code="withdrawn", message="this shard is leaving: open it elsewhere")
        refused = admission_refusal(self._hops.values(), request, opener, replaced, self.settings, self.compute.runner)
        if refused is not None:
            return refused
        if replaced is not None:  # a re-open (failover reuses this hop with a new session): start over cleanly
            self._detach_hop(request.pipeline_id)
        hop = ServedHop(self.nc, request, self.compute, self.limits, self.identity.node_id, opener=opener,
                        opener_key=opener_key)
        self._hops[request.pipeline_id] = hop
        self._hop_opened.set()
        self.compute.active_streams = len(self._hops)
        return hop, replaced

    async def _bring_up(self, request: OpenHop, hop: ServedHop, replaced: ServedHop | None) -> int | None:
        """Close the replaced hop, attach the kept prefix and start the hop; the positions kept, or None when a close,
        re-open or the watchdog detached the hop meanwhile (it is theirs to close)."""
        if replaced is not None:
            await self._finish_closing(request.pipeline_id, replaced)
        # Before the hop serves: no step of its session can come before this answer anyway.
        cached = await self.compute.attach_prefix(request, hop.opener)
        async with self._hop_changes:  # a close detaches under it: none can overtake the start
            if self._hops.get(request.pipeline_id) is not hop:
                return None
            await hop.start()
        return cached
