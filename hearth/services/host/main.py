"""The `hearth host` process: read the mesh's coverage, load the contiguous layer range that fits this host's memory
budget and most improves it (hearth/services/host/planner.py), serve it as `hearth shard` would, and move to fill a hole
when one opens (a host left), or a step toward it when only a chain of moves can fill it, to a range that keeps every
layer only this host holds, after the hole has lasted `rebalance_hold_s`.

The model may be a folder, a GGUF file, a hub id or `store:NAME`: its layers' sizes come from hearth/services/host/
model_layout.py before anything is fetched, and only the chosen range is then downloaded or fetched.

Coverage comes from a read model this process keeps itself (an in-process projector of the shard events on a
temporary SQLite file, rebuilt from the log if SQLite finds it damaged: hearth/readmodels/scratch_model.py), read
as hearth/services/host/coverage.py says. A move withdraws the old range at once, lets
the calls going through it end, then loads the new one; the others wait for it meanwhile, while they hear its
heartbeats of the range it left (heartbeats_while_moving).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Set
from pathlib import Path

import torch
from nats.aio.client import Client as NatsClient

from hearth.events.models import ShardWithdrawn
from hearth.inference import InferenceError
from hearth.inference.cache_ranges import release_range
from hearth.inference.devices import device_memory_available_bytes
from hearth.inference.memory import MiB, shown_mb
from hearth.readmodels.catch_up import read_model_caught_up
from hearth.readmodels.queries import coverage_text
from hearth.readmodels.scratch_model import ScratchModelGivenUp
from hearth.services.common.config import HearthSettings
from hearth.services.common.config_processes import ShardSettings, serve_shards_refused
from hearth.services.common.lifecycle import Stopped, unless_stopped
from hearth.services.common.metrics import serve_process_metrics
from hearth.services.common.scratch_folders import ScratchFolder
from hearth.services.broker.connection import connect_nats, drain_or_close, until_stopped_or_closed
from hearth.services.host.coverage import (
    MOVED, CoverageReader, HoleWithoutMove, coverage_from, coverage_model, earlier_shards_gone, warn_of_other_schemes,
)
from hearth.services.host.last_range import LastRange, last_range_file, remember_range, remembered_range
from hearth.services.host.model_layout import ModelLayout, model_layout
from hearth.services.host.moving import Move, heartbeats_while_moving, say_move_abandoned
from hearth.services.host.planner import LayerRange, choose_range, choose_range_remembering, next_range
from hearth.services.shard.main import (
    ShardInputRefused,
    ShardRefused,
    unreadable_model,
    configure_torch_threads,
    default_node_id,
    load_shard,
    quantize_setting,
    resolve_compute,
    serve_loaded_shard,
)
from hearth.services.shard.claim import ShardIdTaken
from hearth.services.shard.memory_plan import kv_reserve_bytes
from hearth.services.weights_store import WeightsStoreError

log = logging.getLogger(__name__)


# A KV reserve left at its default takes at most this share of a `--memory-budget-mb` (the default alone can exceed
# a small budget, leaving no room for any layer).
DEFAULT_KV_RESERVE_MAX_BUDGET_SHARE = 0.25


def with_memory_budget(settings: HearthSettings, memory_budget_mb: float | None) -> HearthSettings:
    """The settings with `--memory-budget-mb` as this host's `[shard] max_memory_mb` (when given), and a KV reserve
    not set explicitly (file or environment) capped at DEFAULT_KV_RESERVE_MAX_BUDGET_SHARE of it."""
    if memory_budget_mb is None:
        return settings
    shard = settings.shard
    update: dict[str, float] = {"max_memory_mb": memory_budget_mb}
    left_default = "kv_cache_budget_mb" not in shard.model_fields_set
    if left_default:
        update["kv_cache_budget_mb"] = min(shard.kv_cache_budget_mb,
                                           DEFAULT_KV_RESERVE_MAX_BUDGET_SHARE * memory_budget_mb)
    capped = shard.model_copy(update=update)
    if left_default:  # still a default, not the operator's: the range's shard may take less (shard_kv_budget_bytes)
        capped.model_fields_set.discard("kv_cache_budget_mb")
    return settings.model_copy(update={"shard": capped})


async def planned_budget_bytes(shard: ShardSettings, device: torch.device, node: str) -> int:
    """The bytes this host plans its weights and KV reserve within: its budget (`[shard] max_memory_mb`), or what
    `device` has free when that is less (with a warning): a range chosen by the budget alone would not fit, the host
    would be killed loading it, and again on every restart."""
    budget_bytes = int(shard.max_memory_mb * MiB)
    available = await asyncio.to_thread(device_memory_available_bytes, device)
    if available is None or available >= budget_bytes:
        return budget_bytes
    log.warning("host %s: its memory budget of %.1f MB (--memory-budget-mb, else [shard] max_memory_mb) is more than "
                "the %.1f MB free on %s: choosing layers that fit what is free", node, shard.max_memory_mb,
                available / MiB, device)
    return available


def budget_refusal(layer_bytes: list[int], budget_bytes: int, shard: ShardSettings, served_id: str) -> str | None:
    """Why a memory budget of `budget_bytes` (weights plus the KV reserve) can serve no layer of `served_id`, whose
    layers weigh `layer_bytes`, whatever the mesh serves; None when some layer fits."""
    if any(size <= budget_bytes - kv_reserve_bytes(shard) for size in layer_bytes):
        return None
    return (f"a memory budget of {shown_mb(budget_bytes)} MB holds no layer of {served_id}: the smallest needs "
            f"{shown_mb(min(layer_bytes, default=0))} MB plus {shown_mb(kv_reserve_bytes(shard))} MB "
            "kv_cache_budget_mb")


async def wait_for_hole(coverage: CoverageReader, current: LayerRange, shard_id: str, layer_bytes: list[int],
                        weights_budget: int, settings: HearthSettings,
                        leave_out: Set[str] = frozenset()) -> LayerRange:
    """The range to move to, once a hole has lasted `rebalance_hold_s` and a range keeping this host's last replicas
    fills some of it (planner.better_range) or, when none does, brings this host a step nearer it so that the next
    host in the chain can fill it (planner.shifted_range).

    Hosts that saw the same hole and hold the same layers must not all move at once (each sees the other holding
    their layers, and together they would drop the last replica): they take turns, the n-th in shard-id order among
    the live holders of its layers (`CoverageReader.turn`) waiting n + 1 holds, so the first's move is in every read
    model before the next one decides, and the next sees no hole any more, or its layers held nowhere else. The
    checks are jittered so that hosts do not look in step. While another host moves (CoverageReader.move_under_way),
    the hold starts over once its new range is advertised: before, the next host in turn, seeing the hole still open
    while the first loaded it, moved into it too; never longer than `move_wait_max_s` per hole.

    `leave_out`: shards of this node not to count besides `shard_id`, those of an earlier run that no longer answered
    at start (earlier_shards_gone): counted, their adverts (alive until the health timeout) passed for other replicas
    of this host's layers."""
    host = settings.research.distributed_inference.host
    hold_s: float | None = None
    seen_since: float | None = None  # the hole, held for hold_s before moving
    hole_since: float | None = None  # the hole, however long other hosts' moves held this one back
    unfilled = HoleWithoutMove(coverage, shard_id, current, host.move_wait_max_s)
    while True:
        await asyncio.sleep(host.rebalance_check_interval_s * random.uniform(0.5, 1.5))
        replicas = await coverage.replicas(leave_out={shard_id, *leave_out})
        target = next_range(current, replicas, layer_bytes, weights_budget)
        now = time.monotonic()
        if target is None:
            seen_since = hole_since = None
            await unfilled.seen(replicas, now)
            continue
        hole_since = now if hole_since is None else hole_since
        if now - hole_since < host.move_wait_max_s and await coverage.move_under_way(host.move_wait_max_s):
            seen_since = None
        elif seen_since is None:
            seen_since = now
            hold_s = host.rebalance_hold_s * (1 + await coverage.turn(current, shard_id))
        elif now - seen_since >= hold_s:
            return target


async def run_host(*, model: str, memory_budget_mb: float | None, nats_url: str | None,
                   settings: HearthSettings | None = None, node_id: str | None = None, model_id: str | None = None,
                   device: str | None = None, dtype: str | None = None, torch_threads: int | None = None,
                   busy_threads: int | None = None, ready_file: str | None = None,
                   metrics_port: int | None = None, quantize: str | None = None,
                   stop_event: asyncio.Event) -> None:
    """Serve the best range of `model` that fits the budget until `stop_event`, moving when a hole opens; the
    budget counts the weights as `quantize` (None: the host settings) holds them."""
    settings = with_memory_budget(settings or HearthSettings(), memory_budget_mb)
    host, shard = settings.research.distributed_inference.host, settings.shard
    if serve_shards_refused(shard):
        raise ShardRefused("this host's configuration says serve_shards = false")
    configure_torch_threads(torch_threads)
    node = node_id or default_node_id()
    compute_device, compute_dtype = resolve_compute(device, dtype, host)
    setting = quantize_setting(quantize, host, compute_device)
    try:
        layout = await unless_stopped(model_layout(model, model_id=model_id, compute_dtype=compute_dtype,
                                                   quantize=setting, device=compute_device, nats_url=nats_url,
                                                   settings=settings), stop_event)
    except (Stopped, ShardInputRefused):
        raise
    except (InferenceError, WeightsStoreError, ValueError, KeyError, OSError) as error:
        line = f"cannot plan a range of {model}: {(str(error).splitlines() or [repr(error)])[0]}"
        raise unreadable_model(model, line, error) from None
    except Exception as error:  # the broker's refusals and timeouts while reading the store's manifest
        raise ShardRefused(f"cannot read {model} from the store: {type(error).__name__}: {error}") from None
    total_layers, layer_bytes, served_id, scheme = layout.total_layers, layout.layer_bytes, layout.served_id, \
        layout.scheme
    digest = layout.weights_sha256
    budget_bytes = await planned_budget_bytes(shard, compute_device, node)
    weights_budget = budget_bytes - kv_reserve_bytes(shard)
    if (why := budget_refusal(layer_bytes, budget_bytes, shard, served_id)) is not None:  # said before dialling
        raise ShardInputRefused(why)
    nc = await unless_stopped(connect_nats(nats_url, name=f"hearth-host {node}", settings=settings.nats), stop_event)
    metrics_server = None
    with ScratchFolder("hearth-host-") as folder:
        model_view = coverage_model(Path(folder), nc.jetstream(), settings)
        try:
            # Served once for the host's life: its figures carry on across a move (the range is a label).
            metrics_server = serve_process_metrics(metrics_port, f"host {node}", host=settings.metrics.host)
            # Each step before serving ends at a stop (SIGTERM), through the shutdown below.
            await unless_stopped(model_view.start(), stop_event)
            # The first choice reads the whole log first (its live adverts come last): within the short catch-up of
            # later reads, a long log left it choosing as if no host served any layer.
            await unless_stopped(read_model_caught_up(model_view, settings.orchestrator.start_catch_up_timeout_s,
                                                      going_on="choosing layers on what it has read"), stop_event)
            coverage = coverage_from(model_view, settings, node, model_id=served_id, weights_sha256=digest,
                                     total_layers=total_layers, quantization=scheme.label)
            # A run of this host that crashed left its advert alive until the health timeout: counted, its layers
            # would pass for held and the host would choose others, leaving them held by nobody.
            gone = await unless_stopped(earlier_shards_gone(coverage, nc, node, settings), stop_event)
            await warn_of_other_schemes(coverage, node)
            # The range it served before a restart, preferred when still as good (hosts restarted together by a
            # power cut each see an empty mesh: they come back to their old ranges, not all to the first one).
            kept_at = last_range_file(settings, node, served_id)
            remembered = await asyncio.to_thread(
                remembered_range, kept_at, node=node, model_id=served_id, weights_sha256=digest,
                quantization=scheme.label, layer_bytes=layer_bytes, weights_budget=weights_budget)
            chosen = choose_range_remembering(await coverage.replicas(leave_out=gone), layer_bytes, weights_budget,
                                              remembered)

            def remember(served: LayerRange) -> None:
                remember_range(kept_at, LastRange(
                    model_id=served_id, weights_sha256=digest, quantization=scheme.label, total_layers=total_layers,
                    weights_budget_bytes=weights_budget, layer_lo=served.lo, layer_hi=served.hi))

            taken: set[LayerRange] = set()
            arriving: Move | None = None  # the move this host is making to serve `chosen`
            while chosen is not None and not stop_event.is_set():  # None: stopped (a layer fits, checked above)
                log.info("%s", plan_text(node, chosen, layout, weights_budget, await coverage.replicas(leave_out=gone)))
                try:
                    move = await _serve_until_moved(chosen, coverage, nc, model=model, model_id=served_id,
                                                    node=node, settings=settings, device=device, dtype=dtype,
                                                    nats_url=nats_url, layer_bytes=layer_bytes,
                                                    weights_budget=weights_budget, busy_threads=busy_threads,
                                                    ready_file=ready_file, stop_event=stop_event, gone=gone,
                                                    arriving=arriving, remember=remember)
                    chosen, arriving = (move.to if move is not None else None), move
                except ShardIdTaken:
                    taken.add(chosen)
                    if (chosen := await range_besides_taken(coverage, taken, gone, layer_bytes,
                                                            weights_budget)) is None:
                        raise
                    log.warning("host %s: another process of this node serves layers %s: choosing again", node,
                                ", ".join(map(str, sorted(taken, key=lambda taken_range: taken_range.lo))))
        except ScratchModelGivenUp as error:  # the disk damages every file: one line
            raise ShardRefused(str(error)) from None
        finally:
            await model_view.stop()
            if metrics_server is not None:
                metrics_server.stop()
            await drain_or_close(nc, settings.nats.drain_timeout_s)


def plan_text(node: str, chosen: LayerRange, layout: ModelLayout, weights_budget: int, replicas: list[int]) -> str:
    """What a host says it serves, and why: its range, what the range weighs against its budget, and which layers the
    mesh held before (before, a list of one count per layer: eighty numbers for a large model)."""
    weights = sum(layout.layer_bytes[layer] for layer in chosen.layers())
    return (f"host {node}: serving layers {chosen} of {layout.served_id} in {layout.scheme.label} "
            f"({len(chosen.layers())} of its "
            f"{layout.total_layers} layers, {shown_mb(weights)} MB of weights within {shown_mb(weights_budget)} MB: "
            f"the budget less the KV reserve); the mesh held: {coverage_text(enumerate(replicas))}")


async def range_besides_taken(coverage: CoverageReader, taken: Set[LayerRange], gone: Set[str],
                              layer_bytes: list[int], weights_budget: int) -> LayerRange | None:
    """The range to serve once another process of this node kept the shard id of each range in `taken` (hosts of one
    node started together choose the same layers, and so the same id): those layers count as held by it, whether its
    advert has reached the read model or not. None when the best choice would be one of them again."""
    replicas = await coverage.replicas(leave_out=gone)
    for taken_range in taken:
        for layer in taken_range.layers():
            replicas[layer] = max(replicas[layer], 1)
    chosen = choose_range(replicas, layer_bytes, weights_budget)
    return None if chosen in taken else chosen


async def _serve_until_moved(chosen: LayerRange, coverage: CoverageReader, nc: NatsClient, *, model: str,
                             model_id: str, node: str,
                             settings: HearthSettings, device: str | None, dtype: str | None, nats_url: str | None,
                             layer_bytes: list[int], weights_budget: int, busy_threads: int | None,
                             ready_file: str | None, stop_event: asyncio.Event,
                             gone: Set[str] = frozenset(), arriving: Move | None = None,
                             remember: Callable[[LayerRange], None] | None = None) -> Move | None:
    """Serve `chosen` until stopped (returns None) or until a hole is worth moving to (returns the Move, once the
    calls going through `chosen` have ended); `arriving`: the move that brings this host here, whose left shard
    goes on heartbeating until `chosen` is advertised (heartbeats_while_moving), and whose move is said abandoned
    (say_move_abandoned) when `chosen` does not load, as is this one's as soon as a stop comes while it drains (it
    then lets the calls end for at most `[shard] stop_drain_timeout_s`, as any stop does: shard.main.drain_for_stop).
    BrokerConnectionClosed when the host's own connection `nc` is closed for good (it could no longer see holes),
    and the error of a failed read of the coverage likewise. `remember` keeps `chosen` once it is advertised."""
    landed = asyncio.Event()  # `chosen` advertised: the move that brought the host here is over
    beats = None if arriving is None else asyncio.create_task(
        heartbeats_while_moving(nc, settings, node, arriving, landed), name="host-move-heartbeats")
    remembering = None if remember is None else asyncio.create_task(
        remember_when_served(landed, chosen, remember), name="host-remember-range")
    try:
        return await _serve_range(chosen, coverage, nc, model=model, model_id=model_id, node=node, settings=settings,
                                  device=device, dtype=dtype, nats_url=nats_url, layer_bytes=layer_bytes,
                                  weights_budget=weights_budget, busy_threads=busy_threads, ready_file=ready_file,
                                  stop_event=stop_event, gone=gone, arriving=arriving, landed=landed)
    finally:
        for task in (beats, remembering):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


async def remember_when_served(landed: asyncio.Event, chosen: LayerRange,
                               remember: Callable[[LayerRange], None]) -> None:
    """Keep `chosen` as the range last served once it is advertised (`landed`): one that never loaded is not."""
    await landed.wait()  # cancelled with the range's serving, when it never lands
    await asyncio.to_thread(remember, chosen)


async def _serve_range(chosen: LayerRange, coverage: CoverageReader, nc: NatsClient, *, model: str, model_id: str,
                       node: str, settings: HearthSettings, device: str | None, dtype: str | None,
                       nats_url: str | None, layer_bytes: list[int], weights_budget: int, busy_threads: int | None,
                       ready_file: str | None, stop_event: asyncio.Event, gone: Set[str], arriving: Move | None,
                       landed: asyncio.Event) -> Move | None:
    """_serve_until_moved's work; `landed` is set once `chosen` is advertised."""
    try:
        loaded = await load_shard(model=model, lo=chosen.lo, hi=chosen.hi, node=node, settings=settings,
                                  model_id=model_id, device=device, dtype=dtype, quantize=coverage.quantization,
                                  stop_event=stop_event, nats_url=nats_url)
    except BaseException:
        if arriving is not None:
            await say_move_abandoned(nc, settings, ShardWithdrawn(node_id=node, shard_id=arriving.left,
                                                                  reason="shutdown"))
        raise
    shard_id = loaded.identity.shard_id
    leave = asyncio.Event()
    moved: list[LayerRange] = []
    lost: list[BaseException] = []

    async def watch() -> None:
        stop_task = asyncio.create_task(until_stopped_or_closed(nc, stop_event, f"host {node}"))
        hole_task = asyncio.create_task(wait_for_hole(coverage, chosen, shard_id, layer_bytes, weights_budget,
                                                      settings, leave_out=gone))
        try:
            done, _ = await asyncio.wait({stop_task, hole_task}, return_when=asyncio.FIRST_COMPLETED)
            if hole_task in done and hole_task.exception() is not None:
                lost.append(hole_task.exception())  # serving on blind to holes, or ending as if moved, hides it
            elif hole_task in done:
                moved.append(hole_task.result())
                log.info("host %s: moving from layers %s to %s, toward the layers nobody holds, dropping no last "
                         "replica", node, chosen, moved[0])
            elif stop_task.exception() is not None:
                lost.append(stop_task.exception())
        finally:
            for task in (stop_task, hole_task):
                task.cancel()
            await asyncio.gather(stop_task, hole_task, return_exceptions=True)
            leave.set()

    def moving() -> bool:  # a move lets the calls going through the range end first (a stop too, for less long)
        return bool(moved) and not stop_event.is_set()

    def drain_s() -> float:
        return settings.research.distributed_inference.host.move_drain_timeout_s if moving() else 0.0

    abandoned: list[ShardWithdrawn] = []  # one event, however often said: its event_id is its Nats-Msg-Id

    async def abandon_if_stopped() -> bool:
        # Stopped while it drains, the move it said it was making will not land: said as the stop begins, so that
        # the hosts waiting for it need not wait out the stop's drain too ([shard] stop_drain_timeout_s).
        await leave.wait()  # this task's waits end with it (cancelled once the range is no longer served)
        if not moved:
            return True
        await stop_event.wait()
        abandoned.append(ShardWithdrawn(node_id=node, shard_id=shard_id, reason="shutdown"))
        return await say_move_abandoned(nc, settings, abandoned[0])

    watcher = asyncio.create_task(watch(), name="host-rebalance")
    abandoning = asyncio.create_task(abandon_if_stopped(), name="host-move-abandoned")
    try:
        served = await serve_loaded_shard(loaded, nats_url=nats_url, settings=settings, busy_threads=busy_threads,
                                          ready_file=ready_file, stop_event=leave,
                                          withdraw_reason=lambda: MOVED if moving() else "shutdown",
                                          drain_s=drain_s, process_stop=stop_event, serving=landed)
        # A stop that came as the drain ended is said all the same. One the broker did not take was kept in an
        # outbox file besides the shard's own (which held the node's first file then), one only a second host of the
        # node would write: kept again in the first, which the node's next host writes.
        if moved and stop_event.is_set() and not await abandoning:
            await say_move_abandoned(nc, settings, abandoned[0])
    finally:
        for task in (watcher, abandoning):
            task.cancel()
        await asyncio.gather(watcher, abandoning, return_exceptions=True)
    if moved:  # served no more by this process: a process fetching another range may remove its folder
        release_range(loaded.runner.info.path)
    if lost:
        raise lost[0]
    return Move(moved[0], shard_id, served) if moving() else None
