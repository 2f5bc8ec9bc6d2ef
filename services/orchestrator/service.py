"""The orchestrator service: answers `llm.chat.request` in a queue group, validates, routes over its in-process
read model, runs each request as a PipelineRun, and streams frames to the request's reply subject.

A client that goes away (its connection closed, or it stopped reading and unsubscribed its inbox) is noticed
through NATS "no responders": every frame is published with a reply subject of ours, and when nobody listens
on the client's inbox any more the server answers that publish with a 503 status. The run is then cancelled
and, as for every other ending, every hop's session is closed and its KV cache freed. Right after our own
connection reconnected (a broker restart) the client may simply not have resubscribed yet, so 503s within
`client_resubscribe_grace_s` of a reconnect are not taken as the client leaving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from sqlalchemy.orm import sessionmaker

from events.models import EventEnvelope
from events.publish import publish_event
from events.streams import ensure_streams
from readmodels.runner import Projector
from services.common.compute import StepThreads
from services.common.chat_protocol import (
    CHAT_REQUEST_SUBJECT,
    BadRequest,
    ErrorFrame,
    parse_chat_request,
)
from services.orchestrator.catalog import ModelCatalog, UnknownModel
from services.orchestrator.health import RecentFailures
from services.orchestrator.pipeline import PipelinePolicy, PipelineRun
from services.orchestrator.router import ShardRouter
from services.transport.integrity import NormBounds

log = logging.getLogger(__name__)

ORCHESTRATOR_QUEUE_GROUP = "hearth-orchestrators"
# Leaves room for the head to load on the first request of a model.
request_deadline_s = 3600.0
NO_RESPONDERS_STATUS = "503"
client_resubscribe_grace_s = 5.0
catch_up_timeout_s = 2.0


@dataclass
class OrchestratorConfig:
    node_id: str
    db_path: Path | None = None
    enabled: bool = True
    health_timeout_s: float = 30.0
    allow_self_as_shard: bool = False
    max_shards_per_request: int = 16
    max_concurrent_pipelines: int = 4
    policy: PipelinePolicy = field(default_factory=PipelinePolicy)
    model_search_dirs: list[Path] = field(default_factory=list)
    local_model: str | None = None
    # Intra-op threads per step while several pipelines run (services.common.compute.StepThreads).
    busy_threads: int | None = None


class FrameEmitter:
    """Numbers frames (monotonic `seq`) and publishes them to one reply subject; `client_gone` is set when the
    server reports that nobody listens there any more (see the module docstring)."""

    def __init__(self, nc: NatsClient, reply_subject: str) -> None:
        self.nc = nc
        self.reply_subject = reply_subject
        self.seq = 0
        self.client_gone = asyncio.Event()
        self._status_inbox: str | None = None
        self._status_sub = None
        self._reconnects = nc.stats["reconnects"]
        self._reconnect_noticed_at = float("-inf")

    async def start(self) -> "FrameEmitter":
        self._status_inbox = self.nc.new_inbox()
        self._status_sub = await self.nc.subscribe(self._status_inbox, cb=self._on_status)
        return self

    async def _on_status(self, msg: Msg) -> None:
        no_responders = msg.headers is not None and msg.headers.get("Status") == NO_RESPONDERS_STATUS
        if no_responders and not self._reconnected_recently():
            self.client_gone.set()

    def _reconnected_recently(self) -> bool:
        count = self.nc.stats["reconnects"]
        now = time.monotonic()
        if count != self._reconnects:
            self._reconnects, self._reconnect_noticed_at = count, now
        return now - self._reconnect_noticed_at < client_resubscribe_grace_s

    async def emit(self, frame) -> None:
        self._reconnected_recently()
        numbered = frame.model_copy(update={"seq": self.seq})
        self.seq += 1
        await self.nc.publish(self.reply_subject, numbered.model_dump_json().encode(),
                              reply=self._status_inbox or "")

    async def close(self) -> None:
        sub, self._status_sub = self._status_sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


class Orchestrator:
    def __init__(self, nc: NatsClient, config: OrchestratorConfig) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.config = config
        self.catalog = ModelCatalog(config.model_search_dirs, config.local_model)
        self._tmp_dir: tempfile.TemporaryDirectory | None = None
        if config.db_path is None:
            self._tmp_dir = tempfile.TemporaryDirectory(prefix="hearth-orchestrator-")
            config.db_path = Path(self._tmp_dir.name) / "routing.sqlite"
        self.projector = Projector(config.db_path, self.js)
        self.router: ShardRouter | None = None
        self._slots = asyncio.Semaphore(config.max_concurrent_pipelines)
        self._subscription = None
        self._requests: set[asyncio.Task] = set()
        # Per (model, last layer) bounds of the activations that reach us, shared by all requests.
        self._sink_bounds: dict[str, NormBounds] = {}
        self.recent_failures = RecentFailures(config.health_timeout_s)
        self.step_threads = StepThreads(config.busy_threads)
        self._running_pipelines = 0

    async def start(self) -> None:
        await ensure_streams(self.js)
        await self.projector.start()
        self.router = ShardRouter(
            sessionmaker(self.projector.engine), health_timeout_s=self.config.health_timeout_s,
            allow_self_as_shard=self.config.allow_self_as_shard, self_node_id=self.config.node_id,
            max_hops=self.config.max_shards_per_request,
        )
        self._subscription = await self.nc.subscribe(CHAT_REQUEST_SUBJECT, queue=ORCHESTRATOR_QUEUE_GROUP,
                                                     cb=self._on_request)
        await self.nc.flush(timeout=5)
        log.info("orchestrator %s answering %s", self.config.node_id, CHAT_REQUEST_SUBJECT)

    async def stop(self) -> None:
        if self._subscription is not None:
            with contextlib.suppress(Exception):
                await self._subscription.unsubscribe()
        for task in list(self._requests):
            task.cancel()
        if self._requests:
            await asyncio.gather(*self._requests, return_exceptions=True)
        await self.projector.stop()
        self.catalog.close()
        if self._tmp_dir is not None:
            self._tmp_dir.cleanup()

    async def record(self, event: EventEnvelope) -> None:
        try:
            await publish_event(self.js, event)
        except Exception as error:  # losing an audit event must not fail the user's call
            log.warning("event %s not recorded: %s", event.type, error)  # type: ignore[attr-defined]

    async def _catch_up(self) -> None:
        try:
            await self.projector.wait_until_caught_up(timeout_s=catch_up_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            log.warning("routing read model still behind the event log after %s s", catch_up_timeout_s)

    async def _on_request(self, msg: Msg) -> None:
        task = asyncio.create_task(self._serve(msg), name="chat-request")
        self._requests.add(task)
        task.add_done_callback(self._requests.discard)

    async def _serve(self, msg: Msg) -> None:
        if not msg.reply:
            log.warning("chat request without a reply subject dropped")
            return
        emitter = await FrameEmitter(self.nc, msg.reply).start()
        try:
            await asyncio.wait_for(self._serve_request(msg, emitter), timeout=request_deadline_s)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            log.exception("request failed")
            with contextlib.suppress(Exception):
                await emitter.emit(ErrorFrame(seq=0, code="internal_error", message=str(error)[:500]))
        finally:
            await emitter.close()

    async def _serve_request(self, msg: Msg, emitter: FrameEmitter) -> None:
        try:
            request = parse_chat_request(msg.data)
        except BadRequest as error:
            await emitter.emit(ErrorFrame(seq=0, code="bad_request", message=str(error)))
            return
        if not self.config.enabled:
            await emitter.emit(ErrorFrame(seq=0, code="experimental_disabled",
                                          message="distributed inference is disabled on this orchestrator"))
            return
        try:
            model = await self.catalog.get(request.model)
        except UnknownModel as error:
            await emitter.emit(ErrorFrame(seq=0, code="bad_request", message=f"field 'model': {error}"))
            return
        async with self._slots, self._counted_as_running():
            run = PipelineRun(
                nc=self.nc, node_id=self.config.node_id, request=request, model=model, router=self.router,
                policy=self.config.policy, emit=emitter.emit, record=self.record,
                local_model_lookup=lambda: self.catalog.local_model_for(model),
                sink_bounds=self._sink_bounds.setdefault(model.model_id, NormBounds()),
                catch_up=self._catch_up, recent_failures=self.recent_failures,
                step_threads=lambda: self.step_threads.for_streams(self._running_pipelines),
            )
            try:
                await self._run_while_client_listens(run, emitter)
            finally:
                # Shielded: a cancelled request (shutdown) must still free its hops' sessions.
                await asyncio.shield(run.close())

    @contextlib.asynccontextmanager
    async def _counted_as_running(self):
        self._running_pipelines += 1
        try:
            yield
        finally:
            self._running_pipelines -= 1

    async def _run_while_client_listens(self, run: PipelineRun, emitter: FrameEmitter) -> None:
        work = asyncio.create_task(run.run(), name=f"pipeline-{run.pipeline_id}")
        gone = asyncio.create_task(emitter.client_gone.wait(), name=f"client-watch-{run.pipeline_id}")
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Only the client leaving (or our own cancellation, propagated by the wait) stops the work.
            gone.cancel()
            if not work.done():
                work.cancel()
            await asyncio.gather(work, gone, return_exceptions=True)
        if work.cancelled():
            log.info("pipeline %s: the client went away; closing its hops", run.pipeline_id)
            await run.record_client_gone()
            return
        work.result()
