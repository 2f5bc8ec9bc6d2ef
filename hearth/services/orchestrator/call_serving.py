"""CallServing, mixed into the Orchestrator: one chat request served from its arrival to its final frame: its
client stream and keepalives, its deadline, its validation and model, its place in the queue, then its run (one
PipelineRun, or a ChoiceGroup of its `n` choices), whose hops are freed however it ends."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

from nats.aio.msg import Msg

from hearth.protocol.chat import BadRequest, ChatRequest, parse_chat_request
from hearth.protocol.chat_frames import ErrorFrame
from hearth.protocol.subjects import MODELS_REQUEST_SUBJECT
from hearth.services.common.lifecycle import log_failure
from hearth.services.orchestrator.admission import admit_prompt, prompt_room
from hearth.services.orchestrator.call import Call
from hearth.services.orchestrator.catalog import LoadedModel, UnknownModel
from hearth.services.orchestrator.choices import ChoiceClient, ChoiceGroup, choice_request
from hearth.services.orchestrator.client_stream import ClientStream
from hearth.services.orchestrator.deadline import CallDeadline
from hearth.services.orchestrator.discovery import describe_models
from hearth.services.orchestrator.metrics import calls_in_flight, count_request
from hearth.services.orchestrator.pipeline import PipelineRun
from hearth.services.orchestrator.queue import Admission, LeftQueue, Overloaded

# The service's own logger: what a call's serving logs goes out under the name it always did.
log = logging.getLogger("hearth.services.orchestrator.service")


def internal_error_frame(error: Exception) -> ErrorFrame:
    """The `internal_error` frame of an unexpected `error`: its type only, never its message, which may quote the
    request (a pydantic ValidationError echoes the values it refused) and which a gateway logs."""
    return ErrorFrame(seq=0, code="internal_error",
                      message=f"the orchestrator failed: {type(error).__name__} (its log says where)")


class CallServing:
    """Mixed into Orchestrator: reads its settings, queue, catalog, context and its admission checks
    (`_reply_refused`, `_caller_admitted`)."""

    async def _serve(self, msg: Msg) -> None:
        if not msg.reply:
            log.warning("chat request without a reply subject dropped")
            return
        if self._reply_refused(msg):
            return
        caller = await self._caller_admitted(msg)
        if isinstance(caller, ErrorFrame):
            refusal = caller
            # Refused before any work on the call (no inbox watch, no keepalives, no parsing): one frame and done,
            # so that a member flooding the mesh spends little of the time other members' calls need.
            with contextlib.suppress(Exception):  # the asker or the broker is gone: nobody to tell
                await self.nc.publish(msg.reply, refusal.model_dump_json().encode())
            count_request(refusal.code, False)
            return
        try:  # counted in its caller's share from its arrival (FairQueue.arrive) until it ends, however it ends
            client = await ClientStream(self.nc, msg.reply,
                                        resubscribe_grace_s=self.settings.orchestrator.client_resubscribe_grace_s,
                                        missing_grace_s=self.settings.orchestrator.client_missing_grace_s,
                                        probe_timeout_s=self.settings.transport.gone_check_timeout_s).start()
        except BaseException:
            self.queue.leave(caller)
            raise
        client.on_final(functools.partial(self.queue.leave, caller))  # before its final frame: see ClientStream
        keepalive = asyncio.create_task(self._keep_client_told(client), name="client-keepalive")
        deadline = CallDeadline(self.settings.orchestrator.request_deadline_s)
        try:
            async with deadline.held():
                await self._serve_request(msg, client, caller)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            if not (deadline.passed() and isinstance(error, TimeoutError)):  # the deadline's own is no bug
                log_failure(log, "request", error)  # by type and place: its message may quote the prompt
            with contextlib.suppress(Exception):  # one final frame: not if one went out (held to last) already
                if client.final_code is None:
                    await client.send(deadline.frame() if deadline.passed() else internal_error_frame(error))
        finally:
            client.final_going()  # the caller's share back, unless its final frame gave it back already
            count_request(client.final_code, client.client_gone.is_set())
            keepalive.cancel()
            await asyncio.gather(keepalive, return_exceptions=True)
            await client.settle()
            await client.close()

    async def _keep_client_told(self, client: ClientStream) -> None:
        """Keepalives while the call waits for something (a head loading, a slow step, a failover)."""
        interval_s = self.settings.transport.keepalive_interval_s
        while True:
            await asyncio.sleep(interval_s)
            with contextlib.suppress(Exception):  # the broker may be away; the next one tries again
                await client.keep_alive(interval_s)

    async def _serve_request(self, msg: Msg, client: ClientStream, caller: str | None) -> None:
        try:
            request = parse_chat_request(msg.data)
        except BadRequest as error:
            await client.send(ErrorFrame.refusing(error))
            return
        if not self.enabled:
            await client.send(ErrorFrame(seq=0, code="experimental_disabled",
                                         message="distributed inference is disabled on this orchestrator"))
            return
        if request.model is None:
            served = await describe_models(self.context.router, self.catalog)
            if served.default_model is None:
                servable = [m.id for m in served.models if m.complete or m.runnable_locally]
                await client.send(ErrorFrame(seq=0, code="bad_request", message=(
                    f"field 'model': required when the mesh does not serve exactly one model (it serves "
                    f"{len(servable)}: {', '.join(servable) or 'none'}; ask {MODELS_REQUEST_SUBJECT})"),
                    param="model"))
                return
            request = request.model_copy(update={"model": served.default_model})
        try:
            model = await self.catalog.get_requested(request.model)
            # Only cheap checks before the queue: the prompt is tokenized when the call's turn comes.
            prompt_room(request, model)
        except UnknownModel as error:
            await client.send(ErrorFrame(seq=0, code="bad_request", message=f"field 'model': {error}",
                                         refusal="unknown_model", param="model"))
            return
        except BadRequest as error:
            await client.send(ErrorFrame.refusing(error))
            return
        ran = False
        try:
            async with client.final_frame_last(), self.queue.place(caller, client.tell_position, client.client_gone,
                                                                   pipelines=request.n, client=client) as admission:
                try:
                    prompt_ids = await admit_prompt(request, model)
                except BadRequest as error:
                    await client.send(ErrorFrame.refusing(error))
                    return
                request = request.fitted_to_context(len(prompt_ids), model.context_length)
                ran = True
                async with self._counted_as_running():
                    await self._run_admitted(request, model, client, caller, prompt_ids, admission)
        except Overloaded as error:
            await client.send(ErrorFrame(seq=0, code="overloaded", message=str(error),
                                         retry_after_s=error.retry_after_s))
        except LeftQueue:
            log.info("request %s: the client went away while it was queued", request.request_id)
        if ran:
            # After the final frame: the client need not wait for the release.
            await self._release_heap_when_idle()

    async def _run_admitted(self, request: ChatRequest, model: LoadedModel, client: ClientStream, caller: str | None,
                            prompt_ids: list[int], admission: Admission) -> None:
        """Serve an admitted call (its `n` choices as one group, as many at once as it holds places); its hops are
        freed whatever way it ended."""
        queue_wait_s = admission.queue_wait_s
        if request.n > 1:
            group = ChoiceGroup(client, self.context, at_once=admission.places)
            calls = [Call(request=choice_request(request, index), model=model, client=ChoiceClient(group, index),
                          prompt_ids=prompt_ids, caller=caller, queue_wait_s=queue_wait_s)
                     for index in range(request.n)]
            await group.serve(calls)
            return
        run = PipelineRun(Call(request=request, model=model, client=client, prompt_ids=prompt_ids, caller=caller,
                               queue_wait_s=queue_wait_s), self.context)
        try:
            await run.serve()
        finally:
            # Shielded: a cancelled request (shutdown) must still free its hops' sessions.
            await asyncio.shield(run.close())

    @contextlib.asynccontextmanager
    async def _counted_as_running(self):
        """Counts a call as running while it runs."""
        self.context.running_calls += 1
        calls_in_flight.inc()
        try:
            yield
        finally:
            self.context.running_calls -= 1
            calls_in_flight.dec()

    async def _release_heap_when_idle(self) -> None:
        """When no call runs (the last one ended, not cancelled), the heap their head steps freed goes back to the
        OS (ModelCatalog.release_freed_heap)."""
        if self.context.running_calls == 0:
            await self.catalog.release_freed_heap()
