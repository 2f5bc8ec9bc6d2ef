"""HeadSteps: the orchestrator's per-token head work for its calls (final norm + lm_head, sampling, and the embedding
of the sampled token), batched across the calls that decode at once, as a shard batches their layers' decode steps.

With `[orchestrator] head_batch_sessions` > 1 the head steps ready together run as one trip to the compute thread and
one lm_head product (hearth/inference/head_batch.py: greedy rows match their solo tokens exactly, seeded rows are
computed alone); each call's sampling stays its own. A call's step goes into a ReadyQueue
(hearth/services/common/batching.py) and a scheduler loop, started with the first step and stopped by `close`, takes
each batch, runs it on the compute thread and hands every call its own row. Batching is continuous: a batch waits up to
`head_batch_window_ms` for more steps only while fewer are queued than calls are in their decode loop, so a call
decoding alone never waits, and a batch of one row takes the solo path. Rows of different models wait for their own
batch. The embedding of each sampled token (a row lookup, cheap) stays per row in the same trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import torch

from hearth.inference import Head
from hearth.inference.compute_thread import StepThreads, on_compute_thread, use_intra_op_threads
from hearth.inference.head_batch import HeadRow, batched_next_tokens, solo_next_token
from hearth.inference.host_staging import to_host
from hearth.services.common.batching import ReadyQueue
from hearth.services.common.config import OrchestratorSettings
from hearth.services.common.metrics import metrics_observed
from hearth.services.orchestrator.metrics import head_batch_rows_total, head_batches_total, head_step_seconds


@dataclass(frozen=True)
class HeadStep:
    """One call's head step waiting for a batch: its model's head, its row, and the call (whose steps come at its
    pace: the batch window is not waited for calls paced to come later)."""

    head: Head
    row: HeadRow
    call: Hashable = None


class HeadSteps:
    """Turns the hidden states leaving a call's last hop into its next token and that token's embedding."""

    def __init__(self, settings: OrchestratorSettings, step_threads: StepThreads,
                 running_calls: Callable[[], int]) -> None:
        self._step_threads = step_threads
        self._running_calls = running_calls
        self.decoding_calls = 0
        self._ready: ReadyQueue[HeadStep] | None = ReadyQueue(
            window_s=settings.head_batch_window_ms / 1000.0, max_rows=settings.head_batch_sessions,
            open_streams=lambda: self.decoding_calls, group=lambda step: id(step.head),
            stream=lambda step: step.call, merges=lambda step: False,
        ) if settings.head_batch_sessions > 1 else None
        self._scheduler: asyncio.Task | None = None
        self._closed = False

    @property
    def batching_figures(self) -> tuple[int, int]:
        """Head batches run and the call rows in them since start ((0, 0) with batching off)."""
        return (self._ready.batches_total, self._ready.rows_total) if self._ready is not None else (0, 0)

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        """Count a call as decoding (one head step per token expected from it) while inside."""
        self.decoding_calls += 1
        try:
            yield
        finally:
            self.decoding_calls -= 1

    async def next_token(self, head: Head, row: HeadRow, call: Hashable = None) -> tuple[int, torch.Tensor]:
        """The call's next token for the row's hidden states and that token's embedding, on the host (`call`: what
        names the call, for pacing)."""
        if self._ready is None or self._closed:  # closed: a call still finishing steps alone, with no loop to stop
            return await on_compute_thread(self._solo, head, row, self._threads())
        if self._scheduler is None:
            self._scheduler = asyncio.create_task(self._schedule(), name="orchestrator-head-scheduler")
        return await self._ready.put(HeadStep(head, row, call))

    async def close(self) -> None:
        """Stop the scheduler loop; the steps still queued or in its batch are cancelled."""
        self._closed = True
        task, self._scheduler = self._scheduler, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._ready is not None:
            self._ready.cancel_waiting()

    def _threads(self) -> int:
        return self._step_threads.for_streams(self._running_calls())

    @staticmethod
    def _solo(head: Head, row: HeadRow, threads: int) -> tuple[int, torch.Tensor]:
        with _timed_head_step():
            use_intra_op_threads(threads)
            token_id = solo_next_token(head, row)
            return token_id, to_host(head.embed([token_id]))

    async def _schedule(self) -> None:
        """The scheduler loop: takes each batch of ready head steps, runs it, and hands every call its own row."""
        while True:
            batch = await self._ready.next_batch()
            if batch is not None:
                await batch.settle(self._run_batch(batch.items))

    async def _run_batch(self, steps: list[HeadStep]) -> list:
        if metrics_observed():
            head_batches_total.inc()
            head_batch_rows_total.inc(len(steps))
        threads = self._step_threads.for_step(len(steps), self._running_calls(), steps[0].head.weight_bytes)
        return await on_compute_thread(self._tokens_and_embeddings, steps, threads)

    @staticmethod
    def _tokens_and_embeddings(steps: list[HeadStep], threads: int) -> list:
        with _timed_head_step():
            use_intra_op_threads(threads)
            head = steps[0].head
            outcomes = batched_next_tokens(head, [step.row for step in steps])
            return [outcome if isinstance(outcome, Exception) else (outcome, to_host(head.embed([outcome])))
                    for outcome in outcomes]


@contextlib.contextmanager
def _timed_head_step() -> Iterator[None]:
    """Observe the head step run inside (on the compute thread) in `hearth_head_step_seconds`."""
    started = time.perf_counter()
    try:
        yield
    finally:
        if metrics_observed():
            head_step_seconds.observe(time.perf_counter() - started)
