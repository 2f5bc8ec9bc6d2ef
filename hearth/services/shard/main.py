"""The `hearth shard` process: load one layer range, connect, serve until SIGINT/SIGTERM, withdraw."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from hearth.events.models import default_hop_weight
from hearth.events.streams import SHARDS_STREAM
from hearth.protocol.quantization_labels import AUTO_QUANTIZATION
from hearth.protocol.subjects import shard_control_subject, shard_id_for
from hearth.inference import InferenceError, LayerRangeRunner, load_layer_range, weights_sha256
from hearth.inference.checkpoint import is_local_model
from hearth.inference.compute_thread import StepThreads, on_compute_thread
from hearth.inference.ollama_models import served_model_id
from hearth.inference.devices import describe_device, device_memory_allocated_bytes, resolve_placement
from hearth.inference.memory import megabytes
from hearth.inference.quantization import QuantizationError, QuantizationScheme, check_device_supports, \
    parse_quantization
from hearth.inference.stored_precision import resolved_scheme
from hearth.services.common.config import HearthSettings, HostSettings
from hearth.services.common.config_processes import ShardSettings, serve_shards_refused
from hearth.services.common.event_trust import broker_clock_watch
from hearth.services.common.lifecycle import (
    CommandInputRefused, CommandRefused, Stopped, restart_stop_deadline, stop_again_event, unless_stopped,
    write_ready_file,
)
from hearth.services.common.metrics import serve_process_metrics
from hearth.services.broker.connection import connect_nats, drain_or_close, until_stopped_or_closed
from hearth.services.shard.faults import ShardFault
from hearth.services.shard.memory_plan import estimated_need, measured_need, refusal
from hearth.services.shard.compute import ShardCompute
from hearth.services.shard.kept_events import shard_outbox_dir
from hearth.services.shard.metrics import ServingStats
from hearth.services.shard.server import ShardIdentity, ShardServer
from hearth.services.weights_store import WeightsStoreError, resolve_model_source, store_model_name

log = logging.getLogger(__name__)
# What a host's clock beyond [events] max_clock_skew_s of the broker's does (hearth/events/broker_clock.py).
SHARD_CLOCK_CONSEQUENCE = ("ahead, projectors reject its advertisements and heartbeats (future_dated); behind, its "
                           "heartbeats read as old and orchestrators' opens are refused as stale: either way its "
                           "shards are not routed")

_layer_range_re = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


class ShardRefused(CommandRefused):
    """This host may not serve the asked range (its configuration forbids it, or it does not fit)."""


class ShardInputRefused(ShardRefused, CommandInputRefused):
    """What the shard was given cannot be used here, found before anything starts (a device this machine has not, a
    scheme it has no kernel for, a model file of this machine's that is damaged): exit code 2."""


def unreadable_model(model: str, line: str, error: BaseException) -> ShardRefused:
    """The refusal `line` of `model`, which could not be read: the caller's input (exit 2) for a model of this
    machine's (a folder, a GGUF, an Ollama model: damaged, cut short, or no model); exit 1 for a hub or store model,
    which may be unreadable for now (the network, the broker), and for a file the system cannot read (OSError)."""
    return (ShardRefused if isinstance(error, OSError) or not is_local_model(model) else ShardInputRefused)(line)


def with_overrides(settings: HearthSettings, *, max_streams: int | None, heartbeat_s: float | None,
                   ttl_s: float | None, window_chunks: int | None, chunk_bytes: int | None) -> HearthSettings:
    """The settings with the command-line values that were given put in their place."""
    shard = {"max_concurrent_streams": max_streams, "heartbeat_interval_s": heartbeat_s,
             "advertisement_ttl_s": ttl_s}
    transport = {"window_chunks": window_chunks, "chunk_bytes": chunk_bytes}
    return settings.model_copy(update={
        "shard": settings.shard.model_copy(update={k: v for k, v in shard.items() if v is not None}),
        "transport": settings.transport.model_copy(update={k: v for k, v in transport.items() if v is not None}),
    })


def parse_layer_range(text: str) -> tuple[int, int]:
    """`LO-HI`, inclusive, e.g. `0-7`."""
    match = _layer_range_re.match(text)
    if not match:
        raise ValueError(f"layers must look like LO-HI (e.g. 0-7), got {text!r}")
    lo, hi = int(match.group(1)), int(match.group(2))
    if hi < lo:
        raise ValueError(f"layer range {text!r}: HI must be >= LO")
    return lo, hi


def default_node_id() -> str:
    """A stable id of this machine: its host name."""
    return socket.gethostname() or "node"


def configure_torch_threads(threads: int | None) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)


@dataclass
class LoadedShard:
    """A layer range loaded and measured, with what it will advertise; not yet connected."""

    runner: LayerRangeRunner
    identity: ShardIdentity


def resolve_compute(device: str | None, dtype: str | None, host: HostSettings) -> tuple[torch.device, torch.dtype]:
    """The device and dtype from the command line, else the host settings; ShardInputRefused when not available
    here."""
    try:
        return resolve_placement(device or host.device, dtype or host.dtype)
    except ValueError as error:
        raise ShardInputRefused(str(error)) from None


def quantize_setting(quantize: str | None, host: HostSettings, device: torch.device) -> str:
    """The weight quantization setting from the command line, else the host settings: auto (resolved per checkpoint
    by resolve_quantization) or a scheme's label; ShardInputRefused when it is malformed or `device` has no kernel
    for the scheme it names, before any checkpoint is read."""
    setting = quantize or host.quantize
    if setting != AUTO_QUANTIZATION:
        try:
            check_device_supports(parse_quantization(setting), device)
        except QuantizationError as error:
            raise ShardInputRefused(f"--quantize: {_first_line(error)}") from None
    return setting


def resolve_quantization(setting: str | QuantizationScheme,
                         checkpoint: Path | Iterable[tuple[str, str, list[int]]],
                         device: torch.device) -> QuantizationScheme:
    """The scheme `setting` (quantize_setting's) serves `checkpoint` in on `device` (a local checkpoint, or its
    layers' (name, stored type, shape): hearth/inference/stored_precision.py); ShardInputRefused when `device` has no
    kernel for it. Reads the checkpoint's headers: off the event loop."""
    try:
        return resolved_scheme(setting, checkpoint, device)
    except QuantizationError as error:
        raise ShardInputRefused(f"--quantize: {_first_line(error)}") from None


async def load_shard(*, model: str, lo: int, hi: int, node: str, settings: HearthSettings, model_id: str | None,
                     device: str | None, dtype: str | None, stop_event: asyncio.Event,
                     quantize: str | None = None, nats_url: str | None = None) -> LoadedShard:
    """Load layers lo..hi onto this host's device, quantized as `quantize` (None: the host settings) says, if they
    fit its memory limit (checked before reading any weight, and again as measured); ShardRefused naming both
    numbers when they do not.

    `model` may be a folder, a GGUF file, a hub id (only the files holding lo..hi are downloaded) or `store:NAME`
    (only lo..hi's objects are fetched from the community's store through the broker at `nats_url`)."""
    host, shard = settings.research.distributed_inference.host, settings.shard
    compute_device, compute_dtype = resolve_compute(device, dtype, host)
    setting = quantize_setting(quantize, host, compute_device)
    model_path = await fetch_model(model, (lo, hi), nats_url=nats_url, settings=settings, stop_event=stop_event)
    try:
        scheme = await asyncio.to_thread(resolve_quantization, setting, model_path, compute_device)
        if setting == AUTO_QUANTIZATION:
            log.info("layers %d-%d of %s served in %s (--quantize auto: as the checkpoint stores them)", lo, hi,
                     model, scheme.label)
        estimate = await asyncio.to_thread(estimated_need, model_path, lo, hi, compute_dtype, shard, scheme,
                                           compute_device)
    except (InferenceError, ValueError, OSError) as error:
        raise unreadable_model(model, f"cannot load layers {lo}-{hi} of {model}: {_first_line(error)}", error) from None
    if (reason := refusal(lo, hi, estimate, shard, measured=False)) is not None:
        raise ShardRefused(reason)
    allocated_before = device_memory_allocated_bytes(compute_device)
    try:
        runner = await unless_stopped(on_compute_thread(
            load_layer_range, model_path, lo, hi, dtype=compute_dtype, device=compute_device,
            model_id=model_id or _default_model_id(model), cache_budget_bytes=estimate.kv_reserve_bytes,
            session_ttl_s=shard.eviction_idle_s, prefix_ttl_s=shard.prefix_cache_idle_s or None,
            static_cache_tokens=shard.cuda_graph_max_tokens if compute_device.type == "cuda" else None,
            cpu_linear_kernel=shard.cpu_linear_kernel, quantization=scheme), stop_event)
    except torch.OutOfMemoryError as error:  # the device had less room than it said
        raise ShardRefused(f"cannot load layers {lo}-{hi} of {model}: {_first_line(error)}") from None
    except (InferenceError, ValueError) as error:
        raise unreadable_model(model, f"cannot load layers {lo}-{hi} of {model}: {_first_line(error)}", error) from None
    need = measured_need(runner, allocated_before)
    if (reason := refusal(lo, hi, need, shard, measured=True) or static_cache_refusal(runner, shard)) is not None:
        runner.close()
        raise ShardRefused(reason)
    info = runner.info
    digest = await unless_stopped(asyncio.to_thread(weights_sha256, info.path), stop_event)
    shard_id = shard_id_for(info.model_id, lo, hi, node, quantization=runner.quantization)
    described = describe_device(compute_device)
    identity = ShardIdentity(
        shard_id=shard_id, model_id=info.model_id, node_id=node, weights_sha256=digest, layer_lo=lo,
        layer_hi=hi, total_layers=info.num_layers, dtype=info.dtype_name, memory_required_mb=need.required_mb,
        control_subject=shard_control_subject(node, shard_id), device_kind=described.kind,
        device_name=described.name, kv_cache_budget_mb=megabytes(runner.cache_budget_bytes),
        quantization=runner.quantization,
    )
    return LoadedShard(runner, identity)


async def fetch_model(model: str, needed: tuple[int, int], *, nats_url: str | None, settings: HearthSettings,
                      stop_event: asyncio.Event) -> Path:
    """The local folder holding layers `needed` of `model` (hearth/services/weights_store.resolve_model_source);
    ShardRefused with one line when it cannot be found or fetched."""
    lo, hi = needed
    try:
        return await unless_stopped(resolve_model_source(model, needed, nats_url=nats_url, settings=settings),
                                    stop_event)
    except Stopped:
        raise
    except (InferenceError, WeightsStoreError, ValueError, OSError) as error:
        raise unreadable_model(model, f"cannot load layers {lo}-{hi} of {model}: {_first_line(error)}", error) from None
    except Exception as error:  # the broker's refusals and timeouts while fetching from the store
        raise ShardRefused(f"cannot fetch layers {lo}-{hi} of {model}: {type(error).__name__}: "
                           f"{_first_line(error)}") from None


def static_cache_refusal(runner: LayerRangeRunner, shard: ShardSettings) -> str | None:
    """Why a runner whose sessions get static caches cannot serve even one within its KV budget (None: it can)."""
    session_bytes = runner.static_session_bytes
    if session_bytes is None or session_bytes <= runner.cache_budget_bytes:
        return None
    return (f"one session's static KV cache on layers {runner.layer_lo}-{runner.layer_hi} ({session_bytes} bytes: "
            f"every position up to cuda_graph_max_tokens = {shard.cuda_graph_max_tokens}, or the model's context) "
            f"exceeds kv_cache_budget_mb ({runner.cache_budget_bytes} bytes); raise the budget or lower "
            "cuda_graph_max_tokens")


def within_kv_budget(settings: HearthSettings, runner: LayerRangeRunner, shard_id: str) -> HearthSettings:
    """The settings with `max_concurrent_streams` at most the sessions whose static caches the KV budget holds: more
    would evict one another on every step (each evicted hop is re-prefilled), where refusing them (`at_capacity`)
    sends them to a replica or the orchestrator's queue."""
    session_bytes = runner.static_session_bytes
    if session_bytes is None:
        return settings
    fit = runner.cache_budget_bytes // session_bytes
    if fit >= settings.shard.max_concurrent_streams:
        return settings
    log.warning("shard %s: serving at most %d streams, not %d: the KV budget of %.3g MB holds %d sessions' static "
                "caches of %.3g MB", shard_id, fit, settings.shard.max_concurrent_streams,
                runner.cache_budget_bytes / 2**20, fit, session_bytes / 2**20)
    return settings.model_copy(update={"shard": settings.shard.model_copy(update={"max_concurrent_streams": fit})})


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [""])[0]


def _default_model_id(model: str) -> str | None:
    # load_layer_range names a folder (a GGUF file) by its own name (stem); resolving it first must not change that.
    # A stored model is served under its store name, as hosts loading a folder of that name would serve it.
    if (stored := store_model_name(model)) is not None:
        return stored
    return None if Path(model).expanduser().exists() else served_model_id(model)


async def run_shard(
    *,
    model: str,
    layers: str,
    nats_url: str | None,
    node_id: str | None = None,
    model_id: str | None = None,
    settings: HearthSettings | None = None,
    max_streams: int | None = None,
    hop_weight: float = default_hop_weight,
    dtype: str | None = None,
    device: str | None = None,
    quantize: str | None = None,
    heartbeat_s: float | None = None,
    ttl_s: float | None = None,
    fault: str | None = None,
    torch_threads: int | None = None,
    busy_threads: int | None = None,
    ready_file: str | None = None,
    window_chunks: int | None = None,
    chunk_bytes: int | None = None,
    metrics_port: int | None = None,
    stop_event: asyncio.Event,
) -> None:
    """Serve `layers` of `model` until `stop_event`; command-line values given override the settings."""
    settings = with_overrides(settings or HearthSettings(), max_streams=max_streams, heartbeat_s=heartbeat_s,
                              ttl_s=ttl_s, window_chunks=window_chunks, chunk_bytes=chunk_bytes)
    if serve_shards_refused(settings.shard):
        raise ShardRefused("this host's configuration says serve_shards = false")
    try:
        lo, hi = parse_layer_range(layers)
    except ValueError as error:
        raise ShardRefused(str(error)) from None
    configure_torch_threads(torch_threads)
    node = node_id or default_node_id()
    loaded = await load_shard(model=model, lo=lo, hi=hi, node=node, settings=settings, model_id=model_id,
                              device=device, dtype=dtype, quantize=quantize, stop_event=stop_event,
                              nats_url=nats_url)
    await serve_loaded_shard(loaded, nats_url=nats_url, settings=settings, hop_weight=hop_weight, fault=fault,
                             busy_threads=busy_threads, ready_file=ready_file, metrics_port=metrics_port,
                             stop_event=stop_event)


async def serve_loaded_shard(loaded: LoadedShard, *, nats_url: str | None, settings: HearthSettings,
                             hop_weight: float = default_hop_weight, fault: str | None = None,
                             busy_threads: int | None = None,
                             ready_file: str | None = None, metrics_port: int | None = None,
                             stop_event: asyncio.Event,
                             withdraw_reason: Callable[[], str] = lambda: "shutdown",
                             drain_s: Callable[[], float] = lambda: 0.0,
                             process_stop: asyncio.Event | None = None,
                             serving: asyncio.Event | None = None) -> ServingStats:
    """Connect, advertise and serve a loaded range until `stop_event`; then withdraw and free it. When `drain_s()` is
    more than 0 then (a `hearth host` moving), it withdraws first and lets the calls open here end (at most that
    long, less if the process is stopped meanwhile) before it closes what is left. `process_stop`: the process's stop
    (SIGTERM), when it is not `stop_event` itself; a stop too lets the calls open here end first (drain_for_stop).
    `serving` is set once the range is advertised. Returns the figures it served with (its heartbeats')."""
    process_stop = stop_event if process_stop is None else process_stop
    runner, identity = loaded.runner, loaded.identity
    shard_id, lo, hi = identity.shard_id, identity.layer_lo, identity.layer_hi
    settings = within_kv_budget(settings, runner, shard_id)
    server_ref: list[ShardServer] = []
    try:
        nc = await unless_stopped(connect_nats(
            nats_url, name=f"hearth-shard {shard_id}", settings=settings.nats,
            on_reconnected=lambda: server_ref[0].request_readvertise() if server_ref else None), stop_event)
    except BaseException:
        runner.close()
        raise
    compute = ShardCompute(runner, shard_id, settings.shard, fault=ShardFault.parse(fault),
                           step_threads=StepThreads(busy_threads),
                           range_layers=min(hi, identity.total_layers - 1) - lo + 1)
    server = ShardServer(nc, compute, identity, settings, hop_weight=hop_weight, outbox_dir=shard_outbox_dir(settings))
    server_ref.append(server)
    metrics_server = None
    clock_watch = broker_clock_watch(nc, settings, SHARDS_STREAM, f"shard host {identity.node_id}",
                                     SHARD_CLOCK_CONSEQUENCE)
    try:
        compute.start()
        await server.start()
        if clock_watch is not None:
            clock_watch.start()
        metrics_server = serve_process_metrics(metrics_port, f"shard {shard_id}", host=settings.metrics.host)
        print(f"shard {shard_id} ready (layers {lo}-{hi} of {identity.total_layers}, weights "
              f"{identity.weights_sha256[:12]}, {identity.device_kind} {identity.dtype}, quantization "
              f"{identity.quantization}, {identity.memory_required_mb:.1f} MB)", flush=True)
        if ready_file:
            write_ready_file(ready_file, shard_id)
        if serving is not None:
            serving.set()
        # A connection nats-py closed for good would leave the shard advertised but unreachable: it stops instead. So
        # does one that learns late that another process keeps its id (hearth/services/shard/claim.py).
        await server.serve_until(until_stopped_or_closed(nc, stop_event, f"shard {shard_id}"))
        if (drain_timeout_s := drain_s()) > 0:
            await server.withdraw(withdraw_reason())
            log.info("shard %s withdrawn: letting its %d open calls end (at most %.0f s)", shard_id,
                     server.active_streams, drain_timeout_s)
            await server.drain(drain_timeout_s, process_stop)
        if process_stop.is_set():
            await drain_for_stop(server, settings.shard.stop_drain_timeout_s, withdraw_reason(), process_stop)
        return compute.stats
    finally:
        if clock_watch is not None:
            await clock_watch.stop()
        await server.stop(withdraw_reason())
        await compute.close()
        if metrics_server is not None:
            metrics_server.stop()
        await drain_or_close(nc, settings.nats.drain_timeout_s)
        runner.close()


async def drain_for_stop(server: ShardServer, timeout_s: float, reason: str, stop_event: asyncio.Event) -> None:
    """A stopped shard with calls going through it withdraws (routing sends new calls elsewhere) and serves them until
    they end, for at most `timeout_s` or until a second signal (lifecycle.StopEvent.again): stopping at once, it broke
    them (each failed over). The process's stop deadline is put past the wait; without the broker (the calls cannot go
    on) it stops at once."""
    stop_again = stop_again_event(stop_event)
    if timeout_s <= 0 or not server.active_streams or stop_again.is_set() or not server.nc.is_connected:
        return
    restart_stop_deadline(timeout_s)
    ends_at = time.monotonic() + timeout_s  # the withdrawal's publish counts in the wait the deadline leaves room for
    await server.withdraw(reason)
    log.info("shard %s stopping: withdrawn, letting its %d open calls end (at most %.0f s; a second signal stops it "
             "now)", server.identity.shard_id, server.active_streams, timeout_s)
    await server.drain(max(0.0, ends_at - time.monotonic()), stop_again)
