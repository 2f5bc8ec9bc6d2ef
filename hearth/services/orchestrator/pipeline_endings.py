"""CallEnding: how one call's run ends (PipelineRun decides when): its last frame to the client and its last events,
the summaries of its checks first, then `pipeline.completed` or `pipeline.aborted`, which stays the pipeline's last."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from hearth.events.models import KeptPrefix, PipelineAborted, PipelineCompleted
from hearth.protocol.chat_frames import DoneFrame, PipelineAbortedFrame, Timing, Usage
from hearth.services.orchestrator.call import Call
from hearth.services.orchestrator.context import RunContext
from hearth.services.orchestrator.verification import CallVerifier


class CallEnding:
    """Ends `call` well (`complete`), by an abort (`abort`), or after its run was cancelled (`cancelled`); events go
    through `record`, the run's own way of recording one."""

    def __init__(self, call: Call, ctx: RunContext, verifier: CallVerifier,
                 record: Callable[[object], Awaitable[None]]) -> None:
        self.call, self.ctx, self.verifier = call, ctx, verifier
        self._record = record

    async def complete(self, finish_reason: str, kept: KeptPrefix | None) -> None:
        """The `done` frame, then the checks' summaries and `pipeline.completed` (`kept`: the prefix its hops keep)."""
        call = self.call
        duration_ms = call.seconds_since_start() * 1000.0
        tokens_per_second = call.decode_tokens_per_second()
        verification = self.verifier.outcome()  # once: a check left running must not make the event say otherwise
        await call.client.send(DoneFrame(
            seq=0, finish_reason=finish_reason,
            usage=Usage(prompt_tokens=len(call.prompt_ids), completion_tokens=call.completion_tokens),
            timing=Timing(ttft_ms=call.ttft_ms(), tokens_per_second=tokens_per_second, duration_ms=duration_ms,
                          construct_ms=call.construct_ms, failovers=call.failovers,
                          queue_wait_ms=call.queue_wait_ms()), orchestrator=self.ctx.node_id,
            verification=verification,
        ))
        await self._record_checks()
        await self._record(PipelineCompleted(
            node_id=self.ctx.node_id, pipeline_id=call.pipeline_id, prompt_tokens=len(call.prompt_ids),
            completion_tokens=call.completion_tokens, duration_ms=duration_ms,
            tokens_per_second=tokens_per_second, finish_reason=finish_reason, kept_prefix=kept,
            verification=verification))

    async def abort(self, code: str, reason: str) -> None:
        """`pipeline.aborted` (after the checks' summaries), then the `pipeline_aborted` frame."""
        await self.cancelled(code, reason)
        await self.call.client.send(PipelineAbortedFrame(seq=0, code=code, reason=reason))

    async def cancelled(self, code: str, reason: str) -> None:
        """The run was cancelled (its client left, or the call ran past its deadline): record how it ended."""
        await self._record_checks()
        await self._record(PipelineAborted(node_id=self.ctx.node_id, pipeline_id=self.call.pipeline_id, code=code,
                                           reason=reason))

    async def _record_checks(self) -> None:
        """What the call's checks confirmed, recorded before its final event (which stays the pipeline's last)."""
        for summary in self.verifier.summaries():
            await self._record(summary)
