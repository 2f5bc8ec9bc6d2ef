"""ReadyQueue: continuous batching's policy over awaited work items: which of the items ready together a scheduler
loop takes as its next batch, and when; the loop runs the batch itself and hands each submitter its own row's result
(the shard's decode steps, hearth/services/shard/compute.py with hearth/services/shard/batcher.py; the orchestrator's
head steps, hearth/services/orchestrator/head_batcher.py).

Continuous: there is no fixed batch. While a batch computes, the items that arrive queue; the next batch takes what
is queued (at most `max_rows`, all of one group), so streams join and leave between batches. Before handing out a
batch it waits up to `window_s` for more items, but only while fewer items are queued than streams are open
(`open_streams`): one stream alone never waits, so it is not slowed down. Items of another group (e.g. another layer
sub-range) wait for a later batch, and so do items beyond `max_cost` (e.g. tokens): a batch takes items of its group
in arrival order while their costs together stay within it (its first item always).

Pacing (items named by `stream`): the window is not waited for streams known to come only well after it. Each
stream's last arrival and the interval before it say when it is due again; one due later than the wait's end by
more than a quarter of its interval (`pace_slack_intervals`) is not counted among the streams that may still come.
Sessions a pipeline stage apart (two sessions over two shards take turns on each) then never wait for each other:
no step waits out the window for a row that cannot arrive in it. Sessions arriving together are due at once and still
wait for each other. A stream not seen twice yet, or late, counts as coming.

Merging (`merge_window_s` > 0, items named by `stream`, those of `merges`): streams settle into groups that run apart
(eight sessions prefilled as two batches of four decode as two groups of four forever, each a pipeline stage behind
the other). A batch then also waits, up to `merge_window_s`, for the streams that have been arriving at a steady
interval and are due again within that time (last arrival + interval), so one wait joins two groups into one batch
and the groups stay joined: they arrive together from then on and nobody waits again. Worth it where the pipeline's
stages share a machine's cores (one process's step can then use all of them, and the weights are read once per batch
instead of once per group: BENCHMARKS.md, "One batch for hops that share cores"); on separate machines groups keep
every machine busy at once, so it is off by default. A stream that stops coming (closed, or paused) is no longer
due once it is late by more than the merge window, and a late stream is waited for only `window_s` past its due
time; when the due streams would not all fit the batch (`max_rows`), nobody waits for them (that would reshuffle
groups, not join them). Merging waits only for the items of `merges` (the shard's batcher: first hops): merging in
one place is enough (groups that leave it together stay together), and two places each holding one group while
waiting for the other would only delay both.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from hearth.services.common.lifecycle import event_within

Item = TypeVar("Item")
# A stream due later than a wait's end by more than this share of its interval is not waited for (jitter below it).
pace_slack_intervals = 0.25
# How long a stream that stopped coming is remembered for pacing (late by more; merging forgets it sooner).
pace_memory_s = 1.0
# How long a scheduler loop waits for a first item before it asks again: `put` wakes it, so this only bounds the wait
# (an idle shard host or orchestrator is not woken every second for nothing).
scheduler_idle_wait_s = 60.0


@dataclass
class _Waiting(Generic[Item]):
    item: Item
    result: asyncio.Future


class ReadyBatch(Generic[Item]):
    """A batch a scheduler loop took: its items in arrival order, and the futures their submitters await."""

    def __init__(self, waiting: list[_Waiting[Item]]) -> None:
        self._waiting = waiting

    @property
    def items(self) -> list[Item]:
        return [waiting.item for waiting in self._waiting]

    def __len__(self) -> int:
        return len(self._waiting)

    def scatter(self, outcomes: list) -> None:
        """Hand each submitter its row's outcome: a result, or the exception its row raised (one per item, in
        order)."""
        for waiting, outcome in zip(self._waiting, outcomes, strict=True):
            if waiting.result.done():
                continue  # its submitter stopped waiting meanwhile
            if isinstance(outcome, BaseException):
                waiting.result.set_exception(outcome)
            else:
                waiting.result.set_result(outcome)

    def cancel(self) -> None:
        """Cancel the rows not answered yet (the loop stopped while the batch ran)."""
        for waiting in self._waiting:
            waiting.result.cancel()

    async def settle(self, outcomes: Awaitable[list]) -> None:
        """Await the batch's run (one outcome per item) and hand each row its own; a failure of the whole run
        reaches every row, and rows still unanswered when the loop is stopped meanwhile are cancelled."""
        try:
            try:
                results = await outcomes
            except Exception as error:  # the whole batch failed (e.g. an injected fault): every row hears it
                results = [error] * len(self)
            self.scatter(results)
        finally:
            self.cancel()


class ReadyQueue(Generic[Item]):
    """Items ready to run, handed out as batches by `next_batch` (the module docstring says which and when)."""

    def __init__(self, *, window_s: float, max_rows: int, open_streams: Callable[[], int],
                 group: Callable[[Item], Hashable] = lambda item: None, cost: Callable[[Item], int] = lambda item: 1,
                 max_cost: int | None = None, stream: Callable[[Item], Hashable | None] | None = None,
                 merges: Callable[[Item], bool] = lambda item: True, merge_window_s: float = 0.0) -> None:
        if window_s < 0:
            raise ValueError(f"window_s must not be negative, got {window_s}")
        if merge_window_s < 0:
            raise ValueError(f"merge_window_s must not be negative, got {merge_window_s}")
        if merge_window_s and stream is None:
            raise ValueError("merging needs the items' streams (stream=...)")
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        self.window_s = window_s
        self.max_rows = max_rows
        self._open_streams = open_streams
        self._group = group
        self._cost = cost
        self._max_cost = max_cost
        self._queue: list[_Waiting[Item]] = []
        self._arrived = asyncio.Event()
        self.batches_total = 0
        self.rows_total = 0
        self._stream = stream
        self._merges = merges
        self.merge_window_s = merge_window_s
        self._arrivals = StreamArrivals(merge_window_s, keep_s=pace_memory_s)

    def put(self, item: Item) -> asyncio.Future:
        """Queue one item for the next batch of its group; the future its row's result (or exception) is set on."""
        future = asyncio.get_running_loop().create_future()
        if self._stream is not None and (stream := self._stream(item)) is not None:
            self._arrivals.arrived(stream, time.monotonic(), mergeable=self._merges(item))
        self._queue.append(_Waiting(item, future))
        self._arrived.set()
        return future

    async def next_batch(self, idle_wait_s: float = scheduler_idle_wait_s) -> ReadyBatch[Item] | None:
        """The next batch to run, once gathered (window, pacing, merging); None when no item came in `idle_wait_s`."""
        if not self._queue:
            self._arrived.clear()
            if not await event_within(self._arrived, idle_wait_s):  # a stopped loop's cancellation is never lost
                return None
        await self._gather()
        batch = self._take_batch()
        if not batch:
            return None  # every queued item was abandoned
        self.batches_total += 1
        self.rows_total += len(batch)
        return ReadyBatch(batch)

    def cancel_waiting(self) -> None:
        """Cancel every item still queued (its scheduler stops)."""
        for waiting in self._queue:
            waiting.result.cancel()
        self._queue.clear()

    async def _gather(self) -> None:
        """Wait up to the window for more items while some open stream that may still come in it has none queued yet
        (and, merging, up to the merge window for the streams due within it)."""
        started = time.monotonic()
        while True:
            now = time.monotonic()
            until = self._wait_until(started, now)
            if now >= until or len(self._queue) >= self._may_come(until):
                return
            self._arrived.clear()
            if not await event_within(self._arrived, until - now):
                return

    def _queued_streams(self) -> set:
        return {self._stream(w.item) for w in self._queue} if self._stream is not None else set()

    def _may_come(self, until: float) -> int:
        """How many items this batch can hold by `until`: one per open stream, less those paced to come later."""
        open_streams = self._open_streams()
        later = self._arrivals.not_due_by(until, self._queued_streams()) if self._stream is not None else 0
        return min(self.max_rows, max(len(self._queue), open_streams - later))

    def _wait_until(self, started: float, now: float) -> float:
        until = started + self.window_s
        if self.merge_window_s:
            due = self._arrivals.due(now, self._queued_streams())
            # Only a wait that can join every due stream into this batch merges groups; more would only reshuffle.
            if due and len(self._queue) + len(due) <= self.max_rows:
                until = max(until, min(max(due) + self.window_s, started + self.merge_window_s))
        return until

    def _take_batch(self) -> list[_Waiting[Item]]:
        # An item whose submitter stopped waiting (a closed hop's step) is dropped, never run: run late, a closed
        # session's prefill would re-create its KV with no hop left to free it.
        self._queue = [waiting for waiting in self._queue if not waiting.result.done()]
        if not self._queue:
            return []
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


class StreamArrivals:
    """When each stream's items arrive: its last arrival and the interval before it, to tell which are due within
    `horizon_s` (merging: those late by more than the horizon are no longer due) and which come only after a wait
    (pacing). A stream is forgotten once it is late by more than `keep_s` (at least the horizon; closed, or paused),
    or, seen once only, once it has not come back within `single_arrival_kept_horizons` horizons (or `keep_s`)."""

    single_arrival_kept_horizons = 10

    def __init__(self, horizon_s: float, *, keep_s: float = 0.0) -> None:
        self.horizon_s = horizon_s
        self.keep_s = max(horizon_s, keep_s)
        self._last: dict[Hashable, float] = {}
        self._interval: dict[Hashable, float] = {}
        self._mergeable: dict[Hashable, bool] = {}

    @property
    def streams(self) -> int:
        return len(self._last)

    def arrived(self, stream: Hashable, now: float, *, mergeable: bool = True) -> None:
        self._forget_stale(now)
        last = self._last.get(stream)
        if last is not None:
            self._interval[stream] = now - last
        self._last[stream] = now
        self._mergeable[stream] = mergeable

    def due(self, now: float, queued: set) -> list[float]:
        """When the mergeable streams not in `queued` are due again, for those due by `now` + the horizon and late by
        at most the horizon."""
        self._forget_stale(now)
        due = [self._last[stream] + interval for stream, interval in self._interval.items()
               if stream not in queued and self._mergeable[stream]]
        return [expected for expected in due if now - self.horizon_s <= expected <= now + self.horizon_s]

    def not_due_by(self, until: float, queued: set) -> int:
        """How many streams not in `queued` are due only after `until`, by more than `pace_slack_intervals` of their
        interval: they will not come in a wait that ends then."""
        return sum(1 for stream, interval in self._interval.items()
                   if stream not in queued and self._last[stream] + interval > until + pace_slack_intervals * interval)

    def _forget_stale(self, now: float) -> None:
        for stream, last in list(self._last.items()):
            interval = self._interval.get(stream)
            if interval is None:
                stale = now - last > max(self.single_arrival_kept_horizons * self.horizon_s, self.keep_s)
            else:
                stale = last + interval < now - self.keep_s
            if stale:
                del self._last[stream]
                self._interval.pop(stream, None)
                self._mergeable.pop(stream, None)
