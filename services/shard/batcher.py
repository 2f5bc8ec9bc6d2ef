"""DecodeBatcher: continuous batching on a shard: gathers the decode steps its hops have ready and runs them as one
batched step on the compute thread (ShardCompute.run_batch, LayerRangeRunner.decode_batch); each hop gets its own
row's result back and passes it on to its own next hop, as for a solo step.

Continuous: there is no fixed batch. While a batch computes, the steps that arrive queue; the next batch takes
what is queued (at most `max_sessions`), so sessions join and leave between steps. Before starting a batch it
waits up to `window_s` for more steps, but only while fewer steps are queued than hops are open on the shard:
a shard serving one session never waits, so single-session decode is not slowed down. Rows must run the same
sub-range of layers; a step of another sub-range waits for the next batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from services.common.control_protocol import OpenHop
from services.transport import ReceivedStep


@dataclass
class QueuedStep:
    """A hop's decode step waiting for a batch, and where its row's result goes."""

    request: OpenHop
    received: ReceivedStep
    result: asyncio.Future

    @property
    def layers(self) -> tuple[int, int]:
        return self.request.layer_lo, self.request.layer_hi


class DecodeBatcher:
    """Queues decode steps and runs them in batches through `run_batch` (one result or exception per step)."""

    def __init__(self, run_batch: Callable[[list[QueuedStep]], Awaitable[list]], *, window_s: float,
                 max_sessions: int, open_hops: Callable[[], int]) -> None:
        if window_s < 0:
            raise ValueError(f"window_s must not be negative, got {window_s}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        self._run_batch = run_batch
        self.window_s = window_s
        self.max_sessions = max_sessions
        self._open_hops = open_hops
        self._queue: list[QueuedStep] = []
        self._arrived = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.batches_total = 0
        self.rows_total = 0

    async def submit(self, request: OpenHop, received: ReceivedStep):
        """Run one decode step in the next batch; its StepResult, or what its row raised."""
        future = asyncio.get_running_loop().create_future()
        self._queue.append(QueuedStep(request, received, future))
        self._arrived.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain(), name="shard-decode-batcher")
        return await future

    async def close(self) -> None:
        """Stop batching; steps still queued are cancelled."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for queued in self._queue:
            queued.result.cancel()
        self._queue.clear()

    async def _drain(self) -> None:
        while self._queue:
            await self._gather()
            batch = self._take_batch()
            self.batches_total += 1
            self.rows_total += len(batch)
            try:
                outcomes = await self._run_batch(batch)
            except Exception as error:  # the whole batch failed (e.g. an injected fault): every row hears it
                outcomes = [error] * len(batch)
            for queued, outcome in zip(batch, outcomes, strict=True):
                if queued.result.done():
                    continue  # its hop was closed meanwhile
                if isinstance(outcome, BaseException):
                    queued.result.set_exception(outcome)
                else:
                    queued.result.set_result(outcome)

    async def _gather(self) -> None:
        """Wait up to the window for more steps while some open hop has none queued yet."""
        deadline = time.monotonic() + self.window_s
        while len(self._queue) < min(self.max_sessions, self._open_hops()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=remaining)
            except TimeoutError:
                return

    def _take_batch(self) -> list[QueuedStep]:
        layers = self._queue[0].layers
        batch = [queued for queued in self._queue if queued.layers == layers][: self.max_sessions]
        taken = {id(queued) for queued in batch}
        self._queue = [queued for queued in self._queue if id(queued) not in taken]
        return batch
