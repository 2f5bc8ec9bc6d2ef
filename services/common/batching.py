"""ContinuousBatcher: continuous batching of awaited work items: the items ready together run as one batch through
one function, and each submitter gets its own row's result back (the shard's decode steps, services/shard/batcher.py;
the orchestrator's head steps, services/orchestrator/head_batcher.py).

Continuous: there is no fixed batch. While a batch computes, the items that arrive queue; the next batch takes what
is queued (at most `max_rows`, all of one group), so streams join and leave between batches. Before starting a batch
it waits up to `window_s` for more items, but only while fewer items are queued than streams are open (`open_streams`):
one stream alone never waits, so it is not slowed down. Items of another group (e.g. another layer sub-range) wait
for a later batch, and so do items beyond `max_cost` (e.g. tokens): a batch takes items of its group in arrival order
while their costs together stay within it (its first item always).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

Item = TypeVar("Item")


@dataclass
class _Waiting(Generic[Item]):
    item: Item
    result: asyncio.Future


class ContinuousBatcher(Generic[Item]):
    """Queues items and runs them in batches through `run_batch` (one result or exception per item, in order)."""

    def __init__(self, run_batch: Callable[[list[Item]], Awaitable[list]], *, window_s: float, max_rows: int,
                 open_streams: Callable[[], int], group: Callable[[Item], Hashable] = lambda item: None,
                 cost: Callable[[Item], int] = lambda item: 1, max_cost: int | None = None,
                 name: str = "continuous-batcher") -> None:
        if window_s < 0:
            raise ValueError(f"window_s must not be negative, got {window_s}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        self._run_batch = run_batch
        self.window_s = window_s
        self.max_rows = max_rows
        self._open_streams = open_streams
        self._group = group
        self._cost = cost
        self._max_cost = max_cost
        self._name = name
        self._queue: list[_Waiting[Item]] = []
        self._arrived = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.batches_total = 0
        self.rows_total = 0

    async def submit(self, item: Item):
        """Run one item in the next batch of its group; its result, or what its row raised."""
        future = asyncio.get_running_loop().create_future()
        self._queue.append(_Waiting(item, future))
        self._arrived.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain(), name=self._name)
        return await future

    async def close(self) -> None:
        """Stop batching; items still queued are cancelled."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for waiting in self._queue:
            waiting.result.cancel()
        self._queue.clear()

    async def _drain(self) -> None:
        while self._queue:
            await self._gather()
            batch = self._take_batch()
            self.batches_total += 1
            self.rows_total += len(batch)
            try:
                outcomes = await self._run_batch([waiting.item for waiting in batch])
            except Exception as error:  # the whole batch failed (e.g. an injected fault): every row hears it
                outcomes = [error] * len(batch)
            for waiting, outcome in zip(batch, outcomes, strict=True):
                if waiting.result.done():
                    continue  # its submitter stopped waiting meanwhile
                if isinstance(outcome, BaseException):
                    waiting.result.set_exception(outcome)
                else:
                    waiting.result.set_result(outcome)

    async def _gather(self) -> None:
        """Wait up to the window for more items while some open stream has none queued yet."""
        deadline = time.monotonic() + self.window_s
        while len(self._queue) < min(self.max_rows, self._open_streams()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=remaining)
            except TimeoutError:
                return

    def _take_batch(self) -> list[_Waiting[Item]]:
        group = self._group(self._queue[0].item)
        batch: list[_Waiting[Item]] = []
        cost = 0
        for waiting in self._queue:
            if len(batch) == self.max_rows:
                break
            if self._group(waiting.item) != group:
                continue
            cost += self._cost(waiting.item)
            if batch and self._max_cost is not None and cost > self._max_cost:
                break
            batch.append(waiting)
        taken = {id(waiting) for waiting in batch}
        self._queue = [waiting for waiting in self._queue if id(waiting) not in taken]
        return batch
