"""The `hearth host` process: read the mesh's coverage, load the contiguous layer range that fits this host's memory
budget and most improves it (hearth/services/host/planner.py), serve it as `hearth shard` would, and move to fill a hole
when one opens (a host left), to a range that keeps every layer only this host holds, after the hole has lasted
`rebalance_hold_s`.

The model may be a folder, a GGUF file, a hub id or `store:NAME`: its layers' sizes come from hearth/services/host/
model_layout.py before anything is fetched, and only the chosen range is then downloaded or fetched.

Coverage comes from a read model this process keeps itself (an in-process projector of the shard events on a
temporary SQLite file), with the routing rules' idea of a live shard (hearth/services/orchestrator/router.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Set
from pathlib import Path

import torch
from nats.aio.client import Client as NatsClient
from sqlalchemy.orm import sessionmaker

from hearth.events.streams import SHARDS_STREAM
from hearth.inference import InferenceError
from hearth.inference.cache_ranges import release_range
from hearth.inference.devices import device_memory_available_bytes
from hearth.inference.memory import MiB, megabytes
from hearth.readmodels.catch_up import read_model_caught_up
from hearth.readmodels.queries import ShardCandidate
from hearth.readmodels.retention import retention_policy
from hearth.readmodels.runner import Projector
from hearth.services.common.config import HearthSettings
from hearth.services.common.config_processes import ShardSettings, serve_shards_refused
from hearth.services.common.event_trust import event_verifier, stream_setup
from hearth.services.common.lifecycle import Stopped, unless_stopped
from hearth.services.common.metrics import serve_process_metrics
from hearth.services.common.scratch_folders import ScratchFolder
from hearth.services.broker.connection import connect_nats, drain_or_close, until_stopped_or_closed
from hearth.services.host.model_layout import model_layout
from hearth.services.host.planner import LayerRange, better_range, choose_range, replicas_per_layer
from hearth.services.orchestrator.router import ShardRouter
from hearth.services.transport.probe import ProbeOutcome, probe_outcome
from hearth.services.shard.main import (
    ShardRefused,
    configure_torch_threads,
    default_node_id,
    load_shard,
    resolve_compute,
    resolve_quantization,
    serve_loaded_shard,
)
from hearth.services.shard.claim import ShardIdTaken
from hearth.services.shard.memory_plan import kv_reserve_bytes
from hearth.services.weights_store import WeightsStoreError

log = logging.getLogger(__name__)


# The reason a host's withdrawal gives when it leaves a range to move to another (what other hosts wait for).
MOVED = "moved"

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
    if "kv_cache_budget_mb" not in shard.model_fields_set:
        update["kv_cache_budget_mb"] = min(shard.kv_cache_budget_mb,
                                           DEFAULT_KV_RESERVE_MAX_BUDGET_SHARE * memory_budget_mb)
    return settings.model_copy(update={"shard": shard.model_copy(update=update)})


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


class CoverageReader:
    """How many live replicas hold each layer of one model, read through `router` (the routing rules' idea of a
    live shard) after `catch_up` (waiting for the read model to reach the event log's end) when given."""

    def __init__(self, router: ShardRouter, *, model_id: str, weights_sha256: str, total_layers: int,
                 catch_up: Callable[[], Awaitable[object]] | None = None, quantization: str = "none") -> None:
        self.router, self.catch_up = router, catch_up
        self.model_id, self.weights_sha256, self.total_layers = model_id, weights_sha256, total_layers
        self.quantization = quantization

    async def replicas(self, leave_out: Set[str] = frozenset()) -> list[int]:
        shards, alive = await self._live_shards()
        return replicas_per_layer(shards, total_layers=self.total_layers, weights_sha256=self.weights_sha256,
                                  alive=alive, leave_out=leave_out, quantization=self.quantization)

    async def unanswering_shards_of(self, node_id: str,
                                    answers: Callable[[ShardCandidate], Awaitable[bool]]) -> frozenset[str]:
        """The shards of `node_id` that replicas() counts but that do not `answers` (are not served any more): a
        crashed run's, whose advert lives on until the health timeout. A node may run other processes, whose
        shards answer and stay counted."""
        shards, alive = await self._live_shards()
        mine = [shard for shard in shards if shard.node_id == node_id and self._counted(shard, alive)]
        answered = await asyncio.gather(*(answers(shard) for shard in mine))
        return frozenset(shard.shard_id for shard, answer in zip(mine, answered) if not answer)

    async def turn(self, current: LayerRange, shard_id: str) -> int:
        """This host's place among the live hosts holding any of `current`'s layers (0: first), in shard-id order:
        hosts that could all leave the same layers move one after another (wait_for_hole), never together."""
        shards, alive = await self._live_shards()
        return sum(1 for shard in shards
                   if shard.shard_id < shard_id and self._counted(shard, alive)
                   and shard.layer_lo <= current.hi and current.lo <= shard.layer_hi)

    async def move_under_way(self, within_s: float) -> bool:
        """Whether a host is moving: it withdrew a range of these weights and scheme as MOVED under `within_s` ago,
        and its node has advertised no other range since (it drains, then loads the new one, a hole until then)."""
        shards, _ = await self._live_shards()
        now = self.router.now()
        ours = [shard for shard in shards
                if shard.weights_sha256 == self.weights_sha256 and shard.quantization == self.quantization]

        def landed(moved: ShardCandidate) -> bool:
            return any(shard.node_id == moved.node_id and shard.shard_id != moved.shard_id
                       and shard.advertised_at >= moved.withdrawn_at for shard in ours)

        return any(shard.withdrawn_reason == MOVED and shard.withdrawn_at is not None
                   and now - shard.withdrawn_at < within_s and not landed(shard) for shard in ours)

    def _counted(self, shard: ShardCandidate, alive: Callable[[ShardCandidate], bool]) -> bool:
        return (shard.weights_sha256 == self.weights_sha256 and shard.quantization == self.quantization
                and alive(shard))

    async def _live_shards(self) -> tuple[list[ShardCandidate], Callable[[ShardCandidate], bool]]:
        if self.catch_up is not None:
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await self.catch_up()
        shards = await asyncio.to_thread(self.router.candidates, self.model_id)
        now = self.router.now()
        return shards, lambda shard: self.router.alive(shard, now)


def coverage_from(projector: Projector, settings: HearthSettings, node_id: str, **model) -> CoverageReader:
    """A CoverageReader over this host's own projector (started)."""
    router = ShardRouter(sessionmaker(projector.engine), allow_self_as_shard=True, self_node_id=node_id,
                         health_timeout_s=settings.research.distributed_inference.shard_health_timeout_s,
                         silent_log_grace_s=settings.research.distributed_inference.silent_log_grace_s,
                         read_model_version=lambda: projector.batches_total)
    timeout_s = settings.orchestrator.catch_up_timeout_s
    return CoverageReader(router, catch_up=lambda: projector.wait_until_caught_up(timeout_s=timeout_s), **model)


async def earlier_shards_gone(coverage: CoverageReader, nc: NatsClient, node: str,
                              settings: HearthSettings) -> frozenset[str]:
    """This node's shards in `coverage` whose control subject has no responder or stays silent to `stat`: what a
    crashed run of this host left advertised, which its first choice must not take for a replica."""
    timeout_s = settings.transport.probe_timeout_s

    async def answers(shard: ShardCandidate) -> bool:
        return await probe_outcome(nc, shard, timeout_s) is ProbeOutcome.answered

    gone = await coverage.unanswering_shards_of(node, answers)
    if gone:
        log.info("host %s: not counting its earlier shards that no longer answer: %s", node, ", ".join(sorted(gone)))
    return gone


async def wait_for_hole(coverage: CoverageReader, current: LayerRange, shard_id: str, layer_bytes: list[int],
                        weights_budget: int, settings: HearthSettings,
                        leave_out: Set[str] = frozenset()) -> LayerRange:
    """The range to move to, once a hole has lasted `rebalance_hold_s` and a range keeping this host's last replicas
    fills some of it (planner.better_range).

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
    while True:
        await asyncio.sleep(host.rebalance_check_interval_s * random.uniform(0.5, 1.5))
        target = better_range(current, await coverage.replicas(leave_out={shard_id, *leave_out}), layer_bytes,
                              weights_budget)
        now = time.monotonic()
        if target is None:
            seen_since = hole_since = None
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
    scheme = resolve_quantization(quantize, host, compute_device)
    try:
        layout = await unless_stopped(model_layout(model, model_id=model_id, compute_dtype=compute_dtype,
                                                   scheme=scheme, device=compute_device, nats_url=nats_url,
                                                   settings=settings), stop_event)
    except Stopped:
        raise
    except (InferenceError, WeightsStoreError, ValueError, KeyError, OSError) as error:
        raise ShardRefused(f"cannot plan a range of {model}: {(str(error).splitlines() or [repr(error)])[0]}") \
            from None
    except Exception as error:  # the broker's refusals and timeouts while reading the store's manifest
        raise ShardRefused(f"cannot read {model} from the store: {type(error).__name__}: {error}") from None
    total_layers, layer_bytes, served_id = layout.total_layers, layout.layer_bytes, layout.served_id
    digest = layout.weights_sha256
    budget_bytes = await planned_budget_bytes(shard, compute_device, node)
    weights_budget = budget_bytes - kv_reserve_bytes(shard)
    if not any(size <= weights_budget for size in layer_bytes):  # whatever the mesh serves: said before dialling
        raise ShardRefused(
            f"a memory budget of {megabytes(budget_bytes):.1f} MB holds no layer of {served_id}: the smallest needs "
            f"{megabytes(min(layer_bytes, default=0)):.1f} MB plus {shard.kv_cache_budget_mb:.1f} MB "
            "kv_cache_budget_mb")
    nc = await unless_stopped(connect_nats(nats_url, name=f"hearth-host {node}", settings=settings.nats), stop_event)
    metrics_server = None
    with ScratchFolder("hearth-host-") as folder:
        projector = Projector(Path(folder) / "coverage.sqlite", nc.jetstream(), streams=(SHARDS_STREAM,),
                              retention=retention_policy(settings.readmodels),
                              verifier=event_verifier(settings), stream_setup=stream_setup(settings.nats))
        try:
            # Served once for the host's life: its figures carry on across a move (the range is a label).
            metrics_server = serve_process_metrics(metrics_port, f"host {node}", host=settings.metrics.host)
            await projector.start()
            # The first choice reads the whole log first (its live adverts come last): within the short catch-up of
            # later reads, a long log left it choosing as if no host served any layer.
            await read_model_caught_up(projector, settings.orchestrator.start_catch_up_timeout_s,
                                       going_on="choosing layers on what it has read")
            coverage = coverage_from(projector, settings, node, model_id=served_id, weights_sha256=digest,
                                     total_layers=total_layers, quantization=scheme.label)
            # A run of this host that crashed left its advert alive until the health timeout: counted, its layers
            # would pass for held and the host would choose others, leaving them held by nobody.
            gone = await earlier_shards_gone(coverage, nc, node, settings)
            chosen = choose_range(await coverage.replicas(leave_out=gone), layer_bytes, weights_budget)
            taken: set[LayerRange] = set()
            while chosen is not None and not stop_event.is_set():  # None: stopped (a layer fits, checked above)
                log.info("host %s: serving layers %s of %s in %s (coverage: %s)", node, chosen, served_id,
                         scheme.label, await coverage.replicas())
                try:
                    chosen = await _serve_until_moved(chosen, coverage, nc, model=model, model_id=served_id,
                                                      node=node, settings=settings, device=device, dtype=dtype,
                                                      nats_url=nats_url, layer_bytes=layer_bytes,
                                                      weights_budget=weights_budget, busy_threads=busy_threads,
                                                      ready_file=ready_file, stop_event=stop_event, gone=gone)
                except ShardIdTaken:
                    taken.add(chosen)
                    if (chosen := await range_besides_taken(coverage, taken, gone, layer_bytes,
                                                            weights_budget)) is None:
                        raise
                    log.warning("host %s: another process of this node serves layers %s: choosing again", node,
                                ", ".join(map(str, sorted(taken, key=lambda taken_range: taken_range.lo))))
        finally:
            await projector.stop()
            if metrics_server is not None:
                metrics_server.stop()
            await drain_or_close(nc, settings.nats.drain_timeout_s)


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
                             gone: Set[str] = frozenset()) -> LayerRange | None:
    """Serve `chosen` until stopped (returns None) or until a hole is worth moving to (returns the new range);
    BrokerConnectionClosed when the host's own connection `nc` is closed for good (it could no longer see holes), and
    the error of a failed read of the coverage likewise."""
    loaded = await load_shard(model=model, lo=chosen.lo, hi=chosen.hi, node=node, settings=settings,
                              model_id=model_id, device=device, dtype=dtype, quantize=coverage.quantization,
                              stop_event=stop_event, nats_url=nats_url)
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
                log.info("host %s: moving from layers %s to %s, which fills a hole and drops no last replica", node,
                         chosen, moved[0])
            elif stop_task.exception() is not None:
                lost.append(stop_task.exception())
        finally:
            for task in (stop_task, hole_task):
                task.cancel()
            await asyncio.gather(stop_task, hole_task, return_exceptions=True)
            leave.set()

    def drain_s() -> float:  # a move lets the calls going through the range end first; a stop does not wait
        moving = moved and not stop_event.is_set()
        return settings.research.distributed_inference.host.move_drain_timeout_s if moving else 0.0

    watcher = asyncio.create_task(watch(), name="host-rebalance")
    try:
        await serve_loaded_shard(loaded, nats_url=nats_url, settings=settings, busy_threads=busy_threads,
                                 ready_file=ready_file, stop_event=leave,
                                 withdraw_reason=lambda: MOVED if moved else "shutdown", drain_s=drain_s,
                                 drain_interrupted=stop_event)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if moved:  # served no more by this process: a process fetching another range may remove its folder
        release_range(loaded.runner.info.path)
    if lost:
        raise lost[0]
    return moved[0] if moved and not stop_event.is_set() else None
