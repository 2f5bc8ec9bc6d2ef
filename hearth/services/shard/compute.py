"""ShardCompute: runs one step of a hop on the compute thread (input check, injected faults, the layers) and
keeps what the shard reports about its work (tokens served, step latencies, sessions and cache bytes).

Batched steps go through a scheduler loop (`start`, `close`): a hop puts its step in the StepQueue
(hearth/services/shard/batcher.py) and awaits its row; the loop takes each batch, checks every row's input and runs the
sound ones as one `LayerRangeRunner.step_batch` on the compute thread, then hands each hop its own row's result.
Other steps (alone, or a long prefill in turns) run from the hop's own task: the input check, then the layers through
`LayerRangeRunner.begin_forward` and `advance`.

Integrity: every step's input is checked (NaN, Inf, per-position L2 norm far above what this shard has
received before) before its layers run (hearth/services/shard/input_checks.py).

Why a cache snapshot: the runner's lock may be held for a whole forward (a batched decode step), so asking
the runner how many sessions it caches would make a liveness probe wait behind it. The compute thread records
the figures after every step and reset instead, and `stat` reads them without waiting for anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hearth.inference import LayerRangeRunner
from hearth.inference.batched import BatchRow
from hearth.inference.layer_pass import SteppedForward
from hearth.inference.compute_thread import (StepThreads, compute_executor, on_compute_thread, on_thread,
                                            prefill_executor, use_intra_op_threads)
from hearth.inference.host_staging import to_device, to_host
from hearth.inference.heap import release_freed_heap
from hearth.services.common.config import ShardSettings
from hearth.protocol.control import OpenHop, PrefixBlocks
from hearth.services.shard.batcher import QueuedStep, StepQueue
from hearth.services.shard.faults import ShardFault
from hearth.services.shard.metrics import ServingStats, ShardStepMetrics, watch_serving
from hearth.services.transport import FrameKind, ReceivedStep
from hearth.services.shard.input_checks import HopInputChecks



def runner_session(request: OpenHop) -> str:
    """The runner's key for a hop's session: its pipeline's id with its session's, so that an `open` naming another
    pipeline's session id (ids travel in plain headers) gets a session of its own, never that pipeline's KV."""
    return f"{request.pipeline_id}/{request.session_id}"


@dataclass(frozen=True)
class StepResult:
    """What a step produced: its output, or the check its input failed (then nothing was run)."""

    output: torch.Tensor | None
    failed_check: str | None
    compute_s: float


@dataclass
class CacheSnapshot:
    sessions: int = 0
    cache_bytes: int = 0


class ShardCompute:
    """The shard's layer runner behind one door: every torch call of the shard goes through here."""

    def __init__(self, runner: LayerRangeRunner, shard_id: str, settings: ShardSettings, *,
                 fault: ShardFault | None = None, step_threads: StepThreads | None = None,
                 range_layers: int | None = None) -> None:
        self.runner = runner
        self.shard_id = shard_id
        # Layers of the shard's whole range: a decode step of part of it is scaled up to this many.
        self.range_layers = range_layers
        self.fault = fault or ShardFault()
        # Sessions that began from kept KV (hearth/inference/prefix_cache.py): what the `only_kept_prefix` fault lies
        # in.
        self.sessions_from_kept: set[str] = set()
        self.step_threads = step_threads or StepThreads()
        self.weight_bytes = runner.weight_bytes
        self.stats = ServingStats()
        self.step_metrics = ShardStepMetrics(shard_id)
        self.cache = CacheSnapshot()
        # Hops open on this shard (set by the server): steps get fewer threads while several run (StepThreads).
        self.active_streams = 0
        self.input_checks = HopInputChecks()
        # A prefill step of at least `prefill_slice_min_tokens` runs `prefill_slice_layers` layers per compute-thread
        # trip, so other hops' steps run between its slices (hearth/inference/layer_pass.py); 0 layers: always whole.
        self.prefill_slice_layers = settings.prefill_slice_layers
        self.prefill_slice_min_tokens = settings.prefill_slice_min_tokens
        # ... of a piece of this many of its tokens while other steps wait for the thread (None: all the rest).
        self.prefill_slice_tokens = settings.prefill_slice_tokens or None
        # Steps run in turns run on a thread this much lower in CPU priority (inference.compute_thread.prefill_executor
        # says why), beside the compute thread's steps; 0: on the compute thread.
        self.prefill_nice = settings.prefill_nice
        self.prefill_thread_steps = 0  # steps running on that thread or waiting for it
        # Steps of several hops run as one batched step (hearth/services/shard/batcher.py) when more than one may; the
        # scheduler loop (`start`) takes them from here.
        self.ready = StepQueue(window_s=settings.batch_window_ms / 1000.0, max_sessions=settings.max_batch_sessions,
                               open_hops=lambda: self.active_streams, max_tokens=settings.max_batch_tokens,
                               merge_window_s=settings.batch_merge_window_ms / 1000.0,
                               ) if settings.max_batch_sessions > 1 else None
        self._scheduler: asyncio.Task | None = None
        watch_serving(self)

    def start(self) -> None:
        """Start the scheduler loop that runs batched steps (none with batching off); call on the event loop."""
        if self.ready is not None and self._scheduler is None:
            self._scheduler = asyncio.create_task(self._schedule(), name=f"shard-scheduler-{self.shard_id}")

    async def close(self) -> None:
        """Stop the scheduler loop; the steps still queued or in its batch are cancelled."""
        task, self._scheduler = self._scheduler, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.ready is not None:
            self.ready.cancel_waiting()

    def serving_figures(self) -> tuple[int, int, int]:
        """Hops open, KV-cache bytes and tokens served, for the metrics (read without waiting for the runner)."""
        return self.active_streams, self.cache.cache_bytes, self.stats.tokens_served_total

    def prefix_figures(self) -> tuple[int, int, int, int, int]:
        """Kept-prefix lookups that found blocks and that did not, entries dropped (idle, or making room), positions
        reused, and prompt positions computed, since start, for the metrics."""
        kept = self.runner.prefix_cache
        if kept is None:
            return 0, 0, 0, 0, self.stats.prefill_tokens_total
        return (kept.hits_total, kept.misses_total, kept.evictions_total, kept.reused_tokens_total,
                self.stats.prefill_tokens_total)

    async def attach_prefix(self, request: OpenHop, opener: str | None) -> int:
        """Start the hop's session on the longest prefix of the blocks `open` named that hops of its `opener` (the
        member whose signature the open verified under; None on an open mesh) kept; the positions it holds."""
        prefix = request.prefix
        if prefix is None:
            return 0
        attached = await on_compute_thread(self.runner.attach_prefix, runner_session(request), prefix.hashes,
                                           prefix.block_tokens, (request.layer_lo, request.layer_hi), opener)
        if attached:
            self.sessions_from_kept.add(runner_session(request))
        return attached

    async def end_session(self, request: OpenHop, keep: PrefixBlocks | None, opener: str | None) -> int:
        """Free the hop's session, keeping the whole blocks of `keep` it holds as a prefix for hops of its `opener`;
        the positions kept."""
        self.sessions_from_kept.discard(runner_session(request))
        if keep is None:
            await self.reset(request)
            return 0
        return await on_compute_thread(self._keep_and_measure, request, keep, opener)

    async def keep_now(self, request: OpenHop, keep: PrefixBlocks, opener: str | None) -> int:
        """Keep a copy of the hop's session's whole blocks of `keep` for hops of its `opener` while it goes on; the
        positions kept."""
        return await on_compute_thread(self._keep_and_measure, request, keep, opener, False)

    async def drop_kept_prefixes(self, opener: str) -> int:
        """Drop every prefix hops of `opener` kept (its member was removed); the bytes freed."""
        return await on_compute_thread(self._drop_kept_and_measure, opener)

    def _drop_kept_and_measure(self, opener: str) -> int:
        freed = self.runner.drop_kept_prefixes(opener)
        self._measure_cache()
        self._release_heap()
        return freed

    def _keep_and_measure(self, request: OpenHop, keep: PrefixBlocks, opener: str | None,
                          end_session: bool = True) -> int:
        kept = self.runner.keep_prefix(runner_session(request), keep.hashes, keep.block_tokens,
                                       (request.layer_lo, request.layer_hi), end_session, opener)
        self._measure_cache()
        if end_session:
            self._release_heap()
        return kept

    def cache_event_figures(self) -> tuple[int, int]:
        """KV-cache evictions (idle or over budget) and CUDA graphs captured since start, for the metrics."""
        return self.runner.evictions_total, self.runner.graph_captures_total

    def batching_figures(self) -> tuple[int, int]:
        """Batched decode steps run and the session rows in them, for the metrics."""
        return self.ready.figures(FrameKind.decode) if self.ready is not None else (0, 0)

    def prefill_batching_figures(self) -> tuple[int, int]:
        """Batched prefill steps run and the session rows in them, for the metrics."""
        return self.ready.figures(FrameKind.prefill) if self.ready is not None else (0, 0)

    async def run(self, request: OpenHop, received: ReceivedStep,
                  still_open: Callable[[], bool] = lambda: True, opener: str | None = None) -> StepResult:
        """Check and run one prefill/decode step; raises what the layers raise (the caller reports it). `still_open`:
        whether the step's hop is still open (`_trip` says why it is asked); `opener`: who opened it (ServedHop)."""
        if self.ready is not None and self._batchable(received):
            if self._scheduler is None:
                raise RuntimeError("batched steps run on the scheduler loop: ShardCompute.start() was not called")
            return await self.ready.put(request, received, opener)
        started = time.perf_counter()
        self.stats.steps_in_compute += 1
        try:
            if self.fault.delay_s and self.fault.active:
                await asyncio.sleep(self.fault.delay_s)
            # One worker-thread trip per step (on a busy machine every hand-off costs a wake-up): the input
            # check, then the layers only if it passed.
            threads = self.step_threads.for_streams(self.active_streams)
            slice_layers = self._slice_layers(received)
            on_prefill_thread = bool(slice_layers and self.prefill_nice)
            thread = prefill_executor(self.prefill_nice) if on_prefill_thread else compute_executor()
            self.prefill_thread_steps += on_prefill_thread
            try:
                trip = functools.partial(self._trip, request, still_open if on_prefill_thread else None)
                failed_check, step, output = await on_thread(thread, trip, self._check_and_forward, request, received,
                                                             opener, threads, slice_layers)
                while step is not None and output is None:
                    output = await on_thread(thread, trip, self._continue, step, threads, slice_layers)
            finally:
                self.prefill_thread_steps -= on_prefill_thread
        finally:
            self.stats.steps_in_compute -= 1
        compute_s = time.perf_counter() - started
        return self._account(request, received, failed_check, output, compute_s)

    async def _schedule(self) -> None:
        """The scheduler loop: takes each batch of ready steps, runs it, and hands every hop its own row's outcome."""
        while True:
            batch = await self.ready.next_batch()
            if batch is not None:
                await batch.settle(self._run_batch(batch.items))

    async def _run_batch(self, batch: list[QueuedStep]) -> list[StepResult | Exception]:
        """Check and run the steps of several hops (one kind) as one batched step; a result or an exception per row."""
        started = time.perf_counter()
        self.stats.steps_in_compute += len(batch)
        try:
            if self.fault.delay_s and self.fault.active:
                await asyncio.sleep(self.fault.delay_s)
            threads = self.step_threads.for_step(len(batch), self.active_streams, self.weight_bytes)
            outcomes = await on_compute_thread(self._check_and_forward_batch, batch, threads)
        finally:
            self.stats.steps_in_compute -= len(batch)
        compute_s = time.perf_counter() - started
        return [outcome if isinstance(outcome, Exception)
                else self._account(queued.request, queued.received, *outcome, compute_s)
                for queued, outcome in zip(batch, outcomes, strict=True)]

    def _account(self, request: OpenHop, received: ReceivedStep, failed_check: str | None,
                 output: torch.Tensor | None, compute_s: float) -> StepResult:
        if failed_check is None:
            output = self.fault.corrupt(output, request,
                                        began_from_kept=runner_session(request) in self.sessions_from_kept)
            self.stats.step_latencies_s.append(compute_s)
            layers_run = request.layer_hi - request.layer_lo + 1
            if received.kind is FrameKind.decode:
                self.stats.decode_step_s.append(compute_s * (self.range_layers or layers_run) / layers_run)
            self.stats.tokens_served_total += int(received.tensor.shape[1])
            if received.kind is FrameKind.prefill:
                self.stats.prefill_tokens_total += int(received.tensor.shape[1])
        return StepResult(output, failed_check, compute_s)

    async def evict_idle(self) -> int:
        """Evict the caches of sessions idle for the runner's TTL (`[shard] eviction_idle_s`); how many."""
        return await on_compute_thread(self._evict_idle_and_measure)

    def _evict_idle_and_measure(self) -> int:
        evicted = self.runner.evict_expired()
        if evicted:
            self._measure_cache()
            self._release_heap()
        return len(evicted)

    async def reset(self, request: OpenHop) -> int:
        """Drop the hop's session's KV cache; the bytes freed."""
        return await on_compute_thread(self._reset_and_measure, runner_session(request))

    def _batchable(self, received: ReceivedStep) -> bool:
        """Decode steps of one token, and on a CPU prefills that run whole (shorter than the sliced ones): a GPU's
        static caches batch decode steps only (a batch of prefills would run them one by one there anyway). A replay
        never: its queries attend one by one, alone (LayerRangeRunner.step_batch would run it solo)."""
        if received.kind is FrameKind.decode:
            return received.tensor.shape[1] == 1
        return (received.kind is FrameKind.prefill and self.runner.device.type == "cpu"
                and self._slice_layers(received) is None)

    def _slice_layers(self, received: ReceivedStep) -> int | None:
        """Layers per compute-thread trip for a long prefill or replay step; None: the whole step in one trip. Sliced
        even while this hop is the only one open (a call that opens meanwhile would wait for a whole chunk on a CPU,
        while a turn costs a fraction of a millisecond against tens of a piece's layer); whole on a GPU (a chunk's
        layer takes well under a millisecond there, about what a turn costs)."""
        if (self.prefill_slice_layers and self.runner.device.type == "cpu" and received.kind is not FrameKind.decode
                and received.tensor.shape[1] >= self.prefill_slice_min_tokens):
            return self.prefill_slice_layers
        return None

    def _check_and_forward(self, request: OpenHop, received: ReceivedStep, opener: str | None, threads: int,
                           slice_layers: int | None) -> tuple[str | None, SteppedForward | None, torch.Tensor | None]:
        """On the compute thread: check the step's input and run the layers (all, or the first slice of them) only if
        it is sound (never garbage); the failed check, or the step begun and its output once it has run whole."""
        use_intra_op_threads(threads)
        failed_check = self._check_input(request, received, opener)
        if failed_check is not None:
            return failed_check, None, None
        self.fault.raise_if_failing()
        try:
            # On a GPU: input queued onto the device, the layers queued, one wait for the output's copy to pinned
            # host memory (hearth/inference/host_staging.py); on the CPU both are no-ops.
            step = self.runner.begin_forward(runner_session(request), to_device(received.tensor, self.runner.device),
                                             received.pos, received.kind.value, (request.layer_lo, request.layer_hi),
                                             received.prompt_tokens)
            output = self._turns(step, slice_layers)
            return None, step, None if output is None else to_host(output)
        finally:
            self._measure_cache()

    def _trip(self, request: OpenHop, still_open: Callable[[], bool] | None, function: Callable, *args):
        """One trip of a step on its thread. The niced prefill thread runs beside the compute thread, so a close of the
        hop can reset the session there before a trip's `begin_forward` (re)creates it, and nobody would free it again:
        such a trip (`still_open` given) that ends on a closed hop drops the session itself. A compute-thread trip
        needs no check: the close's reset queues behind it on the same thread."""
        try:
            return function(*args)
        finally:
            if still_open is not None and not still_open():
                self._reset_and_measure(runner_session(request))

    def _continue(self, step: SteppedForward, threads: int, slice_layers: int | None) -> torch.Tensor | None:
        """On the compute thread: the next slice of a step begun by `_check_and_forward`; its output after the last."""
        use_intra_op_threads(threads)
        try:
            output = self._turns(step, slice_layers)
            return None if output is None else to_host(output)
        finally:
            self._measure_cache()

    def _turns(self, step: SteppedForward, slice_layers: int | None) -> torch.Tensor | None:
        """On the step's thread: its next turns, as long as no other step waits for that thread (then it gets it
        after this turn); the output once the step is done. Why not one trip per turn: on a shared machine each
        trip waits for the event loop's thread to be scheduled, which costs a long prompt more than its pieces.
        On the niced prefill thread only other long prefills wait for it: the compute thread's steps run beside
        its turns (the runner runs different sessions' layers side by side), so they need no small pieces."""
        while True:
            piece_tokens = self.prefill_slice_tokens if slice_layers and self._others_wait() else None
            output = self.runner.advance(step, slice_layers, piece_tokens)
            if output is not None or slice_layers is None or self._others_wait():
                return output

    def _others_wait(self) -> bool:
        # The count includes the asking step; another one is counted before it asks for the thread.
        return (self.prefill_thread_steps if self.prefill_nice else self.stats.steps_in_compute) > 1

    def _check_and_forward_batch(self, batch: list[QueuedStep],
                                 threads: int) -> list[tuple[str | None, torch.Tensor | None] | Exception]:
        """On the compute thread: check every row's input, then run the sound ones as one batched step."""
        use_intra_op_threads(threads)
        outcomes: list = [None] * len(batch)
        rows, sound = [], []
        for index, queued in enumerate(batch):
            failed_check = self._check_input(queued.request, queued.received, queued.opener)
            if failed_check is not None:
                outcomes[index] = (failed_check, None)
                continue
            sound.append(index)
            rows.append(BatchRow(runner_session(queued.request), to_device(queued.received.tensor, self.runner.device),
                                 queued.received.pos, queued.received.kind.value, queued.received.prompt_tokens))
        if not rows:
            return outcomes
        self.fault.raise_if_failing()
        try:
            results = self.runner.step_batch(rows, batch[0].layers)
        finally:
            self._measure_cache()
        for index, result in zip(sound, results, strict=True):
            outcomes[index] = result if isinstance(result, Exception) else (None, to_host(result))
        return outcomes

    def _check_input(self, request: OpenHop, received: ReceivedStep, opener: str | None) -> str | None:
        if self.fault.accuse and self.fault.active:
            return "norm"
        return self.input_checks.check(request, received, opener)

    def _reset_and_measure(self, session_id: str) -> int:
        freed = self.runner.reset(session_id)
        self._measure_cache()
        if freed:  # a hop closed before any step drops nothing: no malloc_trim for a member's open/close churn
            self._release_heap()
        return freed

    def _release_heap(self) -> None:
        if self.runner.device.type == "cpu":
            release_freed_heap()

    def _measure_cache(self) -> None:
        self.cache = CacheSnapshot(sessions=len(self.runner.session_ids()), cache_bytes=self.runner.cache_bytes)
