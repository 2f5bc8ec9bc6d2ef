"""PipelineRun: one Call's loop, from routing to its final frame.

Until the call's status is final the loop takes the call's next outcome and acts on it: a sampled token is streamed,
`finished` completes the call, and a failure (a step's or routing's) goes to the recovery policy (recovery.py), whose
decision the loop carries out: re-prefill on the same chain, rebuild the chain after the broker came back, fail over
around the shard at fault, fall back to a local model, or abort. The first token of every chain comes from the
(re-)prefill of everything known so far (the prompt and every token generated), the others from decode steps, so a
failover or a fallback continues the same text. The call's checks of its hosts' work (verification.py) run beside the
loop; a step they refute is a failure too: the tokens sampled from it on are withdrawn and the call fails over (at
most the protocol's max_withdrawals_per_choice withdrawals: the call ends at a refutation past them). Frames
go to the call's client, events to the orchestrator's outbox; its last frame and events are pipeline_endings.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

from hearth.events.models import (
    IntegrityCorruptionDetected,
    PipelineConstructed,
    PipelineFailover,
    PipelineFallbackLocal,
    PipelineFirstToken,
    PipelineShardStatus,
)
from hearth.inference.compute_thread import on_compute_thread
from hearth.inference.head_batch import HeadRow
from hearth.protocol.chat_frames import (
    PipelineFrame,
    ShardFailoverFrame,
    ShardStatusFrame,
    TokenDeltaFrame,
    TokensWithdrawnFrame,
    max_withdrawals_per_choice,
)
from hearth.services.orchestrator.answer_kv import close_keeping
from hearth.services.orchestrator.call import Call, CallStatus
from hearth.services.orchestrator.chain import HopChain
from hearth.services.orchestrator.local_chain import LocalChain
from hearth.services.orchestrator.construct import ChainBuilder
from hearth.services.orchestrator.context import RunContext
from hearth.services.orchestrator.deadline import passed_deadline
from hearth.services.orchestrator.metrics import CLIENT_GONE, observe_event
from hearth.services.orchestrator.outcomes import (Failure, Finished, RoutingFailure, SampledToken, StepFailure,
                                                   StepOutcome)
from hearth.services.orchestrator.pipeline_endings import CallEnding
from hearth.services.orchestrator.prefill import prefill
from hearth.services.orchestrator.recovery import (PIPELINE_STALLED, SHARD_UNAVAILABLE, Action, CallCounters,
                                                   Decision, RecoveryLimits, decide)
from hearth.services.orchestrator.router import Hop, RoutingError
from hearth.services.orchestrator.verification import CallVerifier
from hearth.services.transport import FrameKind

log = logging.getLogger(__name__)


class PipelineRun:
    """Serves one Call; frames go to `call.client`, events to the context's outbox."""

    def __init__(self, call: Call, ctx: RunContext) -> None:
        self.call = call
        self.ctx = ctx
        self.limits = RecoveryLimits.from_settings(ctx.settings)
        self.verifier = CallVerifier(call, ctx, self._record)
        self.builder = ChainBuilder(call, ctx, record=self.verifier.records)
        self.ending = CallEnding(call, ctx, self.verifier, self._record)
        self.chain: HopChain | LocalChain | None = None
        # The shards of the open chain counted in the context's ShardLoad (released on close).
        self._held: list[str] = []
        # Counts the call with the head batcher while head steps come from it (head_batcher.py).
        self._in_decode_loop = contextlib.ExitStack()
        # Awaited once its first token was streamed (a request's other choices start then: choices.py).
        self.on_first_token: Callable[[PipelineRun], Awaitable[None]] | None = None

    async def serve(self) -> None:
        """Run the call while its client listens, telling its hops that it lives; a client that stops listening
        cancels the run and the call ends `client_gone`. `close` frees its hops whatever way it ended."""
        pipeline_id = self.call.pipeline_id
        work = asyncio.create_task(self.run(), name=f"pipeline-{pipeline_id}")
        gone = asyncio.create_task(self.call.client.client_gone.wait(), name=f"client-watch-{pipeline_id}")
        hops_told = asyncio.create_task(self._keep_hops_told(), name=f"hop-keepalive-{pipeline_id}")
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Only the client leaving (or our own cancellation, propagated by the wait) stops the work.
            for task in (gone, hops_told):
                task.cancel()
            if not work.done():
                work.cancel()
            await asyncio.gather(work, gone, hops_told, return_exceptions=True)
            if (deadline := passed_deadline()) is not None and not self.call.status.final:  # cancelled for it
                await self._end_cancelled(CallStatus.past_deadline, deadline.code, deadline.reason)
        if work.cancelled():
            log.info("pipeline %s: the client went away; closing its hops", pipeline_id)
            await self._end_cancelled(CallStatus.client_gone, CLIENT_GONE, "the client stopped listening")
            return
        work.result()

    async def run(self) -> None:
        """The call's loop: until its status is final, take its next outcome and act on it."""
        call = self.call
        self._enter(CallStatus.routing)
        try:
            while not call.status.final:
                outcome = await self._next_outcome()
                if isinstance(outcome, SampledToken):
                    await self._stream(outcome)
                elif isinstance(outcome, Finished):
                    await self._complete(outcome.reason)
                else:
                    await self._recover(outcome)
        finally:
            self._in_decode_loop.close()

    async def close(self) -> None:
        """End the chain's checks and free every hop's session (called whatever way the call ended); a call that
        ended well has its hops keep the blocks of its positions for calls that begin the same way."""
        try:
            await self.verifier.detach()
            chain, self.chain = self.chain, None
            if isinstance(chain, HopChain):
                await close_keeping(self.ctx, self.builder, chain, self.call.status is CallStatus.finished)
            elif chain is not None:
                await chain.close()
        finally:  # whatever failed on the way: a stream counted for good would make its shards look full forever
            held, self._held = self._held, []
            if held:
                # After the closes went out: the shards read them before any later open of ours.
                self.ctx.load.release(held)

    # ------------------------------------------------------------------ outcomes

    async def _next_outcome(self) -> StepOutcome | RoutingFailure:
        """A new call is routed first; a fresh chain prefills everything known so far and its output gives the
        next token; then each decode step gives one, until the last token was streamed."""
        call = self.call
        refuted = self.verifier.refuted()
        if refuted is not None:
            return refuted
        if call.status is CallStatus.routing:
            failure = await self._route(replacing=None)
            if failure is not None:
                return failure
        if call.status is CallStatus.prefilling:
            # A fresh chain's hops may hold the first positions already (kept prefixes): only the rest is sent.
            start = self.chain.take_reused_tokens() if isinstance(self.chain, HopChain) else 0
            hidden = await on_compute_thread(call.model.head.embed, call.known_ids[start:])
            chunk_tokens = self.verifier.prefill_chunk_tokens(self.ctx.settings.orchestrator.prefill_chunk_tokens,
                                                              hidden)
            output = await prefill(self.chain, hidden, chunk_tokens, start=start, replay_from=len(call.prompt_ids),
                                   make_room=self.verifier.make_room)
        elif call.finish_reason is not None:
            # The answer is final only once the checks of its steps are in.
            return await self.verifier.settle() or Finished(call.finish_reason)
        else:
            output = await self.chain.step(FrameKind.decode, call.next_position, call.next_input)
        if isinstance(output, StepFailure):
            return output
        self.verifier.after_step()
        refuted = await self.verifier.verify_step()
        if refuted is not None:
            return refuted
        self._enter(CallStatus.decoding)
        call.before_sampling()
        # One compute-thread trip per token, shared with the other calls' (HeadSteps): sample, and embed the
        # sampled token for the next step (wasted only on the last token).
        token_id, embedding = await self.ctx.head_steps.next_token(
            call.model.head, HeadRow(output, call.params, call.generator, call.shaping), call=call.pipeline_id)
        return call.accept(token_id, embedding)

    async def _stream(self, token: SampledToken) -> None:
        call = self.call
        first_token = call.first_token_at is None
        if first_token:
            call.first_token_at = time.perf_counter()
        if token.shown:
            await call.client.send(TokenDeltaFrame(seq=0, text=token.text, token_id=token.token_id,
                                                   hops=self.chain.shard_ids, logprobs=call.last_logprobs))
        if first_token:
            await self._record(PipelineFirstToken(node_id=self.ctx.node_id, pipeline_id=call.pipeline_id,
                                                  ttft_ms=call.ttft_ms()))
            if self.on_first_token is not None:
                await self.on_first_token(self)
        call.next_input = token.embedding
        if token.finish_reason is not None:
            call.finish_reason = token.finish_reason
            self._in_decode_loop.close()  # no head step comes from this call any more

    # ------------------------------------------------------------------ recovery

    async def _recover(self, failure: Failure) -> None:
        """Carry out what the recovery policy decides for `failure`, and for each failure met while doing so (a
        failover that finds no chain, a hop refusing to reopen after the broker came back)."""
        next_failure: Failure | None = failure
        while next_failure is not None:
            self._enter(CallStatus.recovering)
            decision = decide(next_failure, self._counters(), self.limits)
            next_failure = await self._carry_out(decision, next_failure)

    def _counters(self) -> CallCounters:
        call = self.call
        return CallCounters(eviction_reprefills=call.eviction_reprefills, failovers=call.failovers,
                            broker_repairs=call.broker_repairs,
                            fallback_requested=call.request.params.fallback_to_local,
                            has_hops=isinstance(self.chain, HopChain))

    async def _carry_out(self, decision: Decision, failure: Failure) -> Failure | None:
        """Do what `decision` says; the failure met on the way, to be decided on in turn, or None."""
        call = self.call
        if decision.action is Action.reprefill:
            call.eviction_reprefills += 1
            log.info("pipeline %s: %s; re-prefilling %d tokens", call.pipeline_id, failure, len(call.known_ids))
            self._enter(CallStatus.prefilling)
            return None
        if isinstance(failure, StepFailure) and failure.kind == "reported":
            await self.verifier.check_report(failure.shard_id)
        if decision.route_around is not None:
            await self._route_around(failure)
            # A check that refuted the same shard meanwhile needs no failover of its own, only its withdrawal.
            refuted = self.verifier.refutation_of(decision.route_around)
            if refuted is not None and failure.rewind_to is None:
                failure = dataclasses.replace(failure, rewind_to=refuted.rewind_to, reason=refuted.reason)
        if isinstance(failure, StepFailure) and failure.rewind_to is not None and not await self._withdraw(failure):
            decision = Decision(Action.abort, code=SHARD_UNAVAILABLE,
                                reason=f"{failure}; the call's tokens were withdrawn {max_withdrawals_per_choice} "
                                       f"times already, the most the protocol lets a choice have")
        hops = list(self.chain.hops) if isinstance(self.chain, HopChain) else []
        await self.close()
        if decision.action is Action.rebuild:
            return await self._rebuild(hops, failure)
        if decision.action is Action.fail_over:
            return await self._route(replacing=failure)
        if decision.action is Action.fall_back:
            await self._fall_back(decision.code, decision.reason)
        else:
            await self._abort(decision.code, decision.reason)
        return None

    async def _route(self, replacing: StepFailure | None) -> RoutingFailure | None:
        """Open a chain over what the router plans and announce it: the call's first chain, or the failover around
        `replacing`'s shard (the call then re-prefills); the routing failure when no chain opens."""
        call, ctx = self.call, self.ctx
        self._enter(CallStatus.routing)
        try:
            self.chain = await self._opened(await self.builder.build())
        except RoutingError as error:
            return RoutingFailure(error.code, error.message, replacing)
        hops = self.chain.shard_ids
        if replacing is None:
            await self._record(PipelineConstructed(
                node_id=ctx.node_id, pipeline_id=call.pipeline_id, request_id=call.request.request_id,
                model_id=call.model.model_id, weights_sha256=call.model.weights_sha256, hops=hops,
                construct_ms=call.construct_ms, caller=call.caller, cached_prompt_tokens=self.chain.reused_tokens))
            await call.client.send(PipelineFrame(seq=0, pipeline_id=call.pipeline_id, hops=hops))
        else:
            call.failovers += 1
            resumed_at = len(call.generated)
            await self._record(PipelineFailover(
                node_id=ctx.node_id, pipeline_id=call.pipeline_id, failed_shard_id=replacing.shard_id,
                replacement_hops=hops, reason=replacing.kind, resumed_at_token=resumed_at))
            await call.client.send(ShardFailoverFrame(seq=0, failed_shard_id=replacing.shard_id,
                                                      replacement_hops=hops, resumed_at_token=resumed_at))
        self._enter(CallStatus.prefilling)
        return None

    async def _route_around(self, failure: StepFailure) -> None:
        """Tell the client the shard at fault is degraded (and the event log and other calls' routing, when we
        verified it); this call routes around it from now on."""
        call, ctx = self.call, self.ctx
        log.warning("pipeline %s: %s", call.pipeline_id, failure)
        # Events blame a shard only on what we verified; a hop's `reported` word reroutes this call, no other.
        if failure.kind == "corrupt" and failure.check:
            await self._record(IntegrityCorruptionDetected(node_id=ctx.node_id, pipeline_id=call.pipeline_id,
                                                           shard_id=failure.shard_id, check=failure.check))
        status = dict(shard_id=failure.shard_id, status="degraded", reason=failure.reason)
        if failure.verified:
            ctx.recent_failures.add(failure.shard_id)
            await self._record(PipelineShardStatus(node_id=ctx.node_id, pipeline_id=call.pipeline_id, **status))
        await call.client.send(ShardStatusFrame(seq=0, **status))
        call.excluded[failure.shard_id] = failure.reason

    async def _withdraw(self, failure: StepFailure) -> bool:
        """A check refuted the output at `failure.rewind_to`: the tokens sampled from it on are withdrawn (the client
        is told how many it keeps) and the call goes on from the last token before it. False, withdrawing nothing,
        when the call withdrew tokens max_withdrawals_per_choice times already: a client takes no more (the call
        ends)."""
        call = self.call
        keep = max(0, failure.rewind_to - len(call.prompt_ids) + 1)
        if keep >= len(call.generated):
            return True
        if call.withdrawals >= max_withdrawals_per_choice:
            return False
        call.withdrawals += 1
        withdrawn = len(call.generated) - keep
        call.rewind(keep)
        log.warning("pipeline %s: withdrawing %d tokens computed from a refuted step", call.pipeline_id, withdrawn)
        await call.client.send(TokensWithdrawnFrame(seq=0, kept_tokens=keep, shard_id=failure.shard_id,
                                                    reason=failure.reason))
        return True

    async def _rebuild(self, hops: list[Hop], failure: StepFailure) -> StepFailure | None:
        """Our broker connection dropped mid-step (no shard to blame): once we, the hops and the client are reachable,
        reopen the same hops and re-prefill; a hop that refuses, or has no responder `client_resubscribe_grace_s` after
        we are back (its host did not come back), is a failure to decide on; `pipeline_stalled` past `broker_wait_s`."""
        call, nc, settings = self.call, self.ctx.nc, self.ctx.settings
        call.broker_repairs += 1
        log.warning("pipeline %s: %s; rebuilding it once the broker is back", call.pipeline_id, failure)
        deadline = time.monotonic() + settings.orchestrator.broker_wait_s
        gone_after = None  # when a hop without a responder is gone: the grace after we are back
        while time.monotonic() < deadline:
            if nc.is_connected and await call.client.reachable(settings.transport.control_timeout_s):
                gone_after = gone_after or time.monotonic() + settings.orchestrator.client_resubscribe_grace_s
                chain = self.builder.over(hops)
                reopened = await chain.open()
                if reopened is None:
                    self.chain = await self._opened(chain)
                    self._enter(CallStatus.prefilling)
                    return None
                await chain.close()
                # A shard that said no, or is gone for good: route around it as usual (a replica may serve the call).
                if reopened.kind == "refused" or (reopened.kind == "gone" and time.monotonic() > gone_after):
                    return reopened
            # The hops' own connections may come back a little after ours.
            await asyncio.sleep(settings.nats.reconnect_wait_s)
        await self._abort(PIPELINE_STALLED, f"{failure.reason}; not back within "
                                            f"{settings.orchestrator.broker_wait_s:.0f} s")
        return None

    async def _fall_back(self, code: str, reason: str) -> None:
        """Go on with a local model of the call's (the same loop prefills everything known on it and decodes on);
        abort with `code` when none can serve the call."""
        call = self.call
        local = await self.ctx.catalog.local_model_for(call.model, call.quantization)
        if local is None:
            await self._abort(code, reason)
            return
        await self._record(PipelineFallbackLocal(node_id=self.ctx.node_id, pipeline_id=call.pipeline_id,
                                                 reason=reason))
        self.chain = LocalChain(local)
        self._enter(CallStatus.prefilling)

    # ------------------------------------------------------------------ status and endings

    def _enter(self, status: CallStatus) -> None:
        left = self.call.advance(status)
        if status is CallStatus.decoding:
            if left is not CallStatus.decoding:
                self._in_decode_loop.enter_context(self.ctx.head_steps.decoding())
        else:
            self._in_decode_loop.close()

    async def _opened(self, chain: HopChain) -> HopChain:
        self.ctx.load.hold(chain.shard_ids)
        self._held = list(chain.shard_ids)
        await self.verifier.attach(chain)
        return chain

    async def _keep_hops_told(self) -> None:
        """Tell the hops of the current chain that this call lives (the client is told by the service)."""
        interval_s = self.ctx.settings.transport.keepalive_interval_s
        while True:
            await asyncio.sleep(interval_s)
            if self.chain is not None:
                await self.chain.keep_alive()
            await self.verifier.keep_alive()

    async def _record(self, event) -> None:
        observe_event(event)
        await self.ctx.outbox.record(event)

    async def _complete(self, finish_reason: str) -> None:
        # Before the last frame, which lets the caller send its next turn: that turn waits for the answer's warm-up.
        kept = self.builder.keep_on_completion(self.chain) if isinstance(self.chain, HopChain) else None
        await self.ending.complete(finish_reason, kept)
        self._enter(CallStatus.finished)

    async def _abort(self, code: str, reason: str) -> None:
        await self.ending.abort(code, reason)
        self._enter(CallStatus.aborted)

    async def _end_cancelled(self, status: CallStatus, code: str, reason: str) -> None:
        """The run was cancelled (its client left, or the call ran past its deadline): record how it ended."""
        self._enter(status)
        await self.ending.cancelled(code, reason)
