"""The orchestrator service: answers `llm.chat.request` in a queue group (and on its own subject, where a
conversation's next turn comes back to it), admits each request (its size, reply subject, signature and its
caller's share), and has CallServing (call_serving.py) validate it, turn it into a Call served by a PipelineRun
(hearth/services/orchestrator/pipeline.py) over its in-process routing read model, and keep the call's client told
that it is alive (keepalives) until its final frame; answers `llm.models` (hearth/services/orchestrator/discovery.py).

A call ends early when its client goes away (ClientStream notices "no responders" on the client's inbox): its
run ends it `client_gone` and, as for every other ending, every hop's session is closed and its KV cache freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from pathlib import Path

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from pydantic import ValidationError

from hearth.events.models import PipelineAborted
from hearth.events.outbox import EventOutbox
from hearth.events.streams import ALL_STREAMS
from hearth.inference.compute_thread import StepThreads
from hearth.readmodels.catch_up import read_model_caught_up
from hearth.readmodels.retention import retention_policy
from hearth.readmodels.runner import Projector
from hearth.readmodels.scratch_model import ScratchReadModel
from hearth.services.common.call_nonces import MeshNonces
from hearth.services.common.call_signing import CallRefused
from hearth.protocol.chat import BadRequest
from hearth.protocol.discovery import ModelsRequest
from hearth.protocol.chat_frames import ErrorFrame
from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT, MODELS_REQUEST_SUBJECT, orchestrator_request_subject
from hearth.protocol.refusals import body_too_large
from hearth.services.common.config import HearthSettings
from hearth.services.common.event_trust import (
    call_verifier,
    event_signing_key,
    event_verifier,
    node_membership,
    steward_keys_from_the_log,
    stream_setup,
)
from hearth.services.common.lifecycle import log_failure, owned_task
from hearth.services.common.scratch_folders import ScratchFolder
from hearth.services.broker.connection import flush_ordered, key_refused_event
from hearth.services.broker.permissions import reply_allowed
from hearth.services.orchestrator.call_serving import CallServing, internal_error_frame
from hearth.services.orchestrator.capacity import ShardLoad
from hearth.services.orchestrator.catalog import ModelCatalog
from hearth.events.streams import MiB
from hearth.services.orchestrator.canaries import CanaryLibrary, CanaryRunner
from hearth.services.orchestrator.hop_owner import community_open_signer
from hearth.services.orchestrator.kept_expiry import sweep_expired, sweep_interval_s
from hearth.services.orchestrator.kept_inputs import KeptInputs
from hearth.services.orchestrator.prefix import KeptChains
from hearth.services.orchestrator.context import RunContext
from hearth.services.orchestrator.guards import RangeGuards
from hearth.services.orchestrator.discovery import describe_models, is_advertised
from hearth.services.orchestrator.head_batcher import HeadSteps
from hearth.services.orchestrator.health import RecentFailures
from hearth.services.orchestrator.metrics import (ORCHESTRATOR_GONE, calls_by_caller_total, calls_refused_total,
                                                  observe_event)
from hearth.services.orchestrator.queue import FairQueue
from hearth.services.transport.headers import header_bytes
from hearth.services.orchestrator.router import ShardRouter

log = logging.getLogger(__name__)

ORCHESTRATOR_QUEUE_GROUP = "hearth-orchestrators"
# The routing read model in the scratch folder, without --db.
ROUTING_FILE = "routing.sqlite"


class Orchestrator(CallServing):
    """One orchestrator process's service: its subscription, its routing read model, its calls."""

    def __init__(self, nc: NatsClient, settings: HearthSettings, *, node_id: str, db_path: Path | None = None,
                 model_search_dirs: list[Path] | None = None, local_model: str | None = None,
                 busy_threads: int | None = None, outbox_dir: Path | None = None) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.settings = settings
        self.node_id = node_id
        distributed = settings.research.distributed_inference
        self.enabled = settings.research.enable and distributed.enabled
        self.catalog = ModelCatalog(list(model_search_dirs or []), local_model, shard_settings=settings.shard)
        self._tmp_dir: ScratchFolder | None = None
        # Routing reads only events the community's roster vouches for (none rejected on an open mesh), and
        # this orchestrator's own events go out signed by its member key.
        self.projector: Projector | ScratchReadModel
        if db_path is None:  # purely derived and ours alone: rebuilt from the log if SQLite finds it damaged
            self._tmp_dir = ScratchFolder("hearth-orchestrator-")
            self.projector = ScratchReadModel(
                self._tmp_dir.path, self._new_projector, file_name=ROUTING_FILE, owner="orchestrator",
                what="routing read model", rebuild_catch_up_s=settings.orchestrator.start_catch_up_timeout_s)
        else:
            self.projector = self._new_projector(db_path)
        self.db_path = db_path
        self.outbox = EventOutbox(self.js, max_queued=settings.orchestrator.event_queue_max,
                                  retry_wait_s=settings.orchestrator.event_retry_wait_s,
                                  publish_delay_s=settings.orchestrator.event_publish_delay_s,
                                  signing_key=event_signing_key(settings.nats), unsendable=key_refused_event(nc))
        self.outbox_dir = outbox_dir  # its events kept there until stored, across a kill; None: in memory only
        # Calls signed by a roster member, each nonce recorded mesh-wide, on a community mesh; None on an open one.
        # The steward's key as the logs rotate it counts for calls too, with a roster that does not name it yet (kept
        # beside its outbox past the streams' retention).
        self.steward_keys = steward_keys_from_the_log(settings, self.js, ALL_STREAMS, outbox_dir)
        self.call_verifier = call_verifier(settings, self.steward_keys)
        self.call_nonces = None if self.call_verifier is None else MeshNonces.for_calls_of(
            self.call_verifier, self.js, recorded_by=node_id)
        # Calls beyond what may run now wait here, round-robin by caller (hearth/services/orchestrator/queue.py).
        limits = settings.orchestrator
        self.queue = FairQueue(max_running=distributed.max_concurrent_pipelines,
                               max_per_caller=limits.max_streams_per_caller, max_queued=limits.max_queued_requests,
                               max_queued_per_caller=limits.max_queued_per_caller,
                               retry_after_s=limits.overloaded_retry_after_s)
        self._subscription = self._own_subscription = self._models_subscription = None
        # The requests being answered and the sweep of expired kept prefixes' memory: cancelled on stop.
        self._tasks: set[asyncio.Task] = set()
        self.context: RunContext | None = None
        self._canaries: CanaryRunner | None = None
        self._step_threads = StepThreads(busy_threads)

    def _new_projector(self, path: Path) -> Projector:
        settings = self.settings
        return Projector(path, self.js, verifier=event_verifier(settings),
                         retention=retention_policy(settings.readmodels), stream_setup=stream_setup(settings.nats))

    async def read_model_failed(self) -> str:
        """Wait until the routing read model can no longer be kept (routing on it would go stale): the line to end
        with. A `--db` file SQLite finds damaged is the caller's to rebuild; the scratch one only once rebuilding it
        failed `max_rebuilds` times."""
        if isinstance(self.projector, ScratchReadModel):
            await self.projector.found_given_up.wait()
            return str(self.projector.given_up)
        await self.projector.found_unusable.wait()
        return f"--db {self.projector.unusable}"

    async def start(self) -> None:
        """Start serving; OutboxFileUnavailable when `outbox_dir` has no file this process may claim, ReadModelUnusable
        for a damaged `--db` file, ScratchModelGivenUp when every scratch file given was damaged."""
        await self.outbox.start_in(self.outbox_dir, owner=self.node_id)
        await self._end_calls_left_open()
        await self.projector.start()
        if self.call_nonces is not None:
            await self.call_nonces.ready(stream_setup(self.settings.nats))
        if self.steward_keys is not None:
            await self.steward_keys.start()
        distributed = self.settings.research.distributed_inference
        verification = self.settings.verification
        router = ShardRouter(
            self.projector.session_factory, health_timeout_s=distributed.shard_health_timeout_s,
            allow_self_as_shard=distributed.allow_self_as_shard, self_node_id=self.node_id,
            max_hops=distributed.max_shards_per_request, silent_log_grace_s=distributed.silent_log_grace_s,
            read_model_version=lambda: self.projector.batches_total,
            node_membership=node_membership(self.settings, self.steward_keys),
            max_clock_skew_s=self.settings.events.max_clock_skew_s,
        )
        self.catalog.use_advertised(functools.partial(is_advertised, router))
        # Kept prefixes' memory goes when the shards drop their blocks (as this orchestrator knows their setting).
        kept_idle_s = self.settings.shard.prefix_cache_idle_s
        self.context = RunContext(
            nc=self.nc, node_id=self.node_id, settings=self.settings, router=router, projector=self.projector,
            catalog=self.catalog, outbox=self.outbox,
            recent_failures=RecentFailures(distributed.shard_health_timeout_s),
            head_steps=HeadSteps(self.settings.orchestrator, self._step_threads, lambda: self.context.running_calls),
            sink_bounds={},
            load=ShardLoad(retry_s=self.settings.orchestrator.at_capacity_retry_s),
            guards=RangeGuards(verification.guard_margin, verification.guard_min_positions),
            canaries=CanaryLibrary.configured(verification),
            kept_inputs=KeptInputs(int(verification.kept_inputs_mb * MiB), idle_s=kept_idle_s),
            kept_chains=KeptChains(idle_s=kept_idle_s),
            open_signer=community_open_signer(self.outbox.signing_key, self.settings,
                                              self.steward_keys))
        self._canaries = CanaryRunner(self.context, self._record_event)
        self._canaries.start()
        owned_task(self._tasks, sweep_expired([self.context.kept_inputs, self.context.kept_chains],
                                              sweep_interval_s(kept_idle_s)), name="kept-prefix-sweep")
        await read_model_caught_up(self.projector, self.settings.orchestrator.start_catch_up_timeout_s,
                                   going_on="answering calls anyway")
        self._subscription = await self.nc.subscribe(CHAT_REQUEST_SUBJECT, queue=ORCHESTRATOR_QUEUE_GROUP,
                                                     cb=self._on_request)
        # Our own subject (a conversation's next turn) too, in the queue group: one process of a member answers.
        self._own_subscription = await self.nc.subscribe(orchestrator_request_subject(self.node_id),
                                                         queue=ORCHESTRATOR_QUEUE_GROUP, cb=self._on_request)
        self._models_subscription = await self.nc.subscribe(MODELS_REQUEST_SUBJECT, queue=ORCHESTRATOR_QUEUE_GROUP,
                                                            cb=self._on_models_request)
        await flush_ordered(self.nc, self.settings.transport.control_timeout_s)
        log.info("orchestrator %s answering %s and %s", self.node_id, CHAT_REQUEST_SUBJECT,
                 orchestrator_request_subject(self.node_id))

    async def _end_calls_left_open(self) -> None:
        """Record `pipeline.aborted` (`orchestrator_gone`) for each call the process killed before this one left open
        in this outbox file, after what it left unwritten: else each reads as under way in the read models for ever."""
        left_open = self.outbox.calls_left_open
        for pipeline_id in left_open:
            await self._record_event(PipelineAborted(
                node_id=self.node_id, pipeline_id=pipeline_id, code=ORCHESTRATOR_GONE,
                reason="its orchestrator process ended mid-call (killed or crashed); recorded by the next one"))
        if left_open:
            log.warning("orchestrator %s: %d call(s) its killed predecessor left open recorded as aborted (%s)",
                        self.node_id, len(left_open), ORCHESTRATOR_GONE)

    async def _record_event(self, event) -> None:
        """An event of the orchestrator's own (not of one call's run): counted in metrics, then into the outbox."""
        observe_event(event)
        await self.outbox.record(event)

    async def stop(self) -> None:
        for subscription in (self._subscription, self._own_subscription, self._models_subscription):
            if subscription is not None:
                with contextlib.suppress(Exception):
                    await subscription.unsubscribe()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.queue.close()
        for closing in (self._canaries, self.call_nonces):
            if closing is not None:
                await closing.close()
        if self.context is not None:
            await self.context.warm_ups.close()
            await self.context.head_steps.close()
        await self.outbox.stop(self.settings.orchestrator.event_flush_timeout_s)
        if self.steward_keys is not None:
            await self.steward_keys.stop()
        await self.projector.stop()
        self.catalog.close()
        if self._tmp_dir is not None:
            self._tmp_dir.cleanup()

    async def _on_models_request(self, msg: Msg) -> None:
        owned_task(self._tasks, self._answer_models(msg), name="models-request")

    async def _answer_models(self, msg: Msg) -> None:
        if not msg.reply or self._reply_refused(msg):
            return
        try:
            reply = self._oversized(msg)
            if reply is None:
                if msg.data.strip():
                    ModelsRequest.model_validate_json(msg.data)
                reply = await describe_models(self.context.router, self.catalog)
        except ValidationError as error:
            reply = ErrorFrame.refusing(BadRequest.of_validation(error))
        except Exception as error:  # the read model or the catalog failed us: said, as a chat request's failure is
            log_failure(log, "models request", error)
            reply = internal_error_frame(error)
        with contextlib.suppress(Exception):  # the asker or the broker is gone: nobody to tell
            await msg.respond(reply.model_dump_json().encode())

    def _oversized(self, msg: Msg) -> ErrorFrame | None:
        """A `bad_request` for a request whose body or headers are over their limits, checked before either is
        parsed or read: a large body costs many times its size once decoded."""
        limits = self.settings.orchestrator
        if len(msg.data) > (limit := limits.max_request_bytes):
            return ErrorFrame(seq=0, code="bad_request", message=body_too_large(len(msg.data), limit),
                              refusal="request_too_large")
        size = header_bytes(msg.headers)
        if size > limits.max_request_header_bytes:
            return ErrorFrame(seq=0, code="bad_request", message=(
                f"headers: {size} bytes is over max_request_header_bytes {limits.max_request_header_bytes}"))
        return None

    def _reply_refused(self, msg: Msg) -> bool:
        """A request whose reply subject is not a caller's inbox is dropped unanswered (there is nowhere safe to
        answer it), counted and logged without its body: answering would publish with our rights."""
        if reply_allowed(msg.reply, self.call_verifier.role_of if self.call_verifier is not None else None):
            return False
        calls_refused_total.labels("foreign_reply").inc()
        log.warning("%s request dropped: its reply subject is not a caller's inbox", msg.subject)
        return True

    async def _on_request(self, msg: Msg) -> None:
        owned_task(self._tasks, self._serve(msg), name="chat-request")

    async def _caller_admitted(self, msg: Msg) -> str | None | ErrorFrame:
        """The calling member's name (None on an open mesh), or the frame refusing the call: its body or headers
        over their limits, its signature or its nonce (seen on the mesh) refused, or its caller's share full."""
        refusal = self._oversized(msg)
        if refusal is not None:
            return refusal
        caller = None
        if self.call_verifier is not None:
            checked = self.call_verifier.check(msg.subject, msg.reply, msg.data, msg.headers)
            if self.call_nonces is not None and not isinstance(checked, CallRefused):  # before its share is spent
                checked = await self.call_nonces.admitted(checked, msg.headers)
            if isinstance(checked, CallRefused):
                calls_refused_total.labels(checked.reason).inc()
                return ErrorFrame(seq=0, code="overloaded" if checked.retry_after_s else "unauthorized",
                                  message=checked.message, retry_after_s=checked.retry_after_s)
            caller = checked.name
            calls_by_caller_total.labels(caller).inc()  # roster names only: a bounded label set
        overloaded = self.queue.arrive(caller)
        if overloaded is not None:
            return ErrorFrame(seq=0, code="overloaded", message=str(overloaded), retry_after_s=overloaded.retry_after_s)
        return caller
