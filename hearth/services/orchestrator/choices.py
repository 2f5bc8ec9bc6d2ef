"""ChoiceGroup: a request's `n` choices, each a call with a pipeline of its own, sharing the prompt's prefill.

The first choice runs as any call; once its prefill gave its first token, its hops keep a copy of the prompt's
whole blocks (`keep`, hearth/inference/prefix_cache.py) while it goes on, and the other choices start: routing sends
them to those hops (hearth/services/orchestrator/affinity.py) and each prefills only the prompt's last, partial block
before it samples on its own (with `seed`, choice i draws with seed + i), in the weight scheme of the first choice's
chain (as a failover keeps a call's). Every choice's frames go to the one client
tagged with its `choice`; the group's last frame comes once every choice has ended: one done frame (choice 0's finish
reason and timing, every choice's tokens counted, how each ended in `choices`), or, when a choice did not end well,
its final frame (none when the client went away). The request holds a running place of its caller's for each choice, up
to the caller's share (hearth/services/orchestrator/queue.py), and runs as many choices at once as it holds places: the
others start as those end, each still beginning from the prompt's kept blocks.
"""

from __future__ import annotations

import asyncio
import logging

from hearth.protocol.chat import ChatRequest, max_choices
from hearth.protocol.chat_frames import ChoiceEnd, DoneFrame, ErrorFrame, PipelineAbortedFrame, TokenDeltaFrame, Usage
from hearth.services.orchestrator.affinity import hop_ranges
from hearth.services.orchestrator.call import Call
from hearth.services.orchestrator.client_stream import ClientStream
from hearth.services.orchestrator.context import RunContext
from hearth.services.orchestrator.pipeline import PipelineRun
from hearth.services.orchestrator.chain import HopChain

log = logging.getLogger(__name__)

FINAL_FRAMES = (DoneFrame, PipelineAbortedFrame, ErrorFrame)


def choice_request(request: ChatRequest, index: int) -> ChatRequest:
    """Choice `index`'s request: the same, drawing with seed + index when a seed was given."""
    if index == 0 or request.seed is None:
        return request
    return request.model_copy(update={"seed": (request.seed + index) % 2**63})


class ChoiceClient:
    """One choice's view of the request's client: its frames tagged with its index, its final frame held back."""

    def __init__(self, group: "ChoiceGroup", index: int) -> None:
        self.group = group
        self.index = index
        self.client_gone = group.client.client_gone
        self.tokens_sent = 0

    async def send(self, frame) -> None:
        if isinstance(frame, FINAL_FRAMES):
            self.group.finals[self.index] = frame
            return
        if isinstance(frame, TokenDeltaFrame):
            self.tokens_sent += 1
        if "choice" in type(frame).model_fields:
            frame = frame.model_copy(update={"choice": self.index})
        await self.group.client.send(frame)

    async def reachable(self, timeout_s: float) -> bool:
        return await self.group.client.reachable(timeout_s)


class ChoiceGroup:
    """Serves one request's `n` choices over one client stream."""

    def __init__(self, client: ClientStream, ctx: RunContext, at_once: int | None = None) -> None:
        self.client = client
        self.ctx = ctx
        self.finals: dict[int, object] = {}
        self._prefilled = asyncio.Event()
        # The choices run at once: one per running place the request holds (FairQueue.place); the others wait.
        self._room = asyncio.Semaphore(at_once or max_choices)

    async def serve(self, calls: list[Call]) -> None:
        """Run every choice (the first alone until its prompt's blocks are kept), then send the group's last frame;
        every choice's hops are freed whatever way it ended."""
        runs = [PipelineRun(call, self.ctx) for call in calls]
        runs[0].on_first_token = self._share_prefill
        first = asyncio.create_task(self._serve(runs[0]), name=f"choice-0-{calls[0].pipeline_id}")
        # Ends with the group: a first choice that fails before its first token never sets `_prefilled`.
        prefilled = asyncio.create_task(self._prefilled.wait(), name=f"choice-prefill-{calls[0].pipeline_id}")
        others: list[asyncio.Task] = []
        try:
            await asyncio.wait([first, prefilled], return_when=asyncio.FIRST_COMPLETED)
            for run in runs[1:]:
                # In the scheme the first choice's chain serves (when the request named none): each would take the
                # most precise one with room for itself, another one while the first holds its shards.
                run.call.quantization = run.call.quantization or runs[0].call.quantization
            others = [asyncio.create_task(self._serve(run), name=f"choice-{index}-{run.call.pipeline_id}")
                      for index, run in enumerate(runs[1:], start=1)]
            await asyncio.gather(first, *others)
        finally:
            for task in (first, prefilled, *others):
                task.cancel()
            await asyncio.gather(first, prefilled, *others, return_exceptions=True)
        if self.client.client_gone.is_set():
            return  # its choices ended client_gone, with no final frame, as a single call does: nobody to tell
        await self.client.send(self._last_frame(calls))

    async def _serve(self, run: PipelineRun) -> None:
        async with self._room:
            try:
                await run.serve()
            finally:
                # Shielded: a cancelled request (shutdown) must still free its hops' sessions.
                await asyncio.shield(run.close())

    async def _share_prefill(self, run: PipelineRun) -> None:
        """The first choice's first token came: its hops keep the prompt's blocks, and the others may start."""
        try:
            chain, call = run.chain, run.call
            naming = run.builder.naming(call.quantization or "none") if isinstance(chain, HopChain) else None
            kept = naming.kept(call.prompt_ids) if naming is not None else None
            if kept is not None and await chain.keep_now(kept):
                self.ctx.kept_chains.remember(kept.hashes, hop_ranges(chain.hops))
        finally:
            self._prefilled.set()

    def _last_frame(self, calls: list[Call]):
        """One done frame when every choice ended well, else the final frame of the first that did not."""
        ended = [self.finals.get(index) for index in range(len(calls))]
        for index, frame in enumerate(ended):
            if not isinstance(frame, DoneFrame):
                if frame is None:
                    return PipelineAbortedFrame(seq=0, code="internal_error", reason="a choice ended without a frame",
                                                choice=index)
                return frame.model_copy(update={"choice": index}) if "choice" in type(frame).model_fields else frame
        first = ended[0]
        return first.model_copy(update={
            "usage": Usage(prompt_tokens=first.usage.prompt_tokens,
                           completion_tokens=sum(frame.usage.completion_tokens for frame in ended)),
            "choices": [ChoiceEnd(choice=index, finish_reason=frame.finish_reason,
                                  completion_tokens=frame.usage.completion_tokens)
                        for index, frame in enumerate(ended)],
            # Unmet when any choice's checks fell short of the level.
            "verification": next((frame.verification for frame in ended if frame.verification == "unmet"),
                                 first.verification)})
