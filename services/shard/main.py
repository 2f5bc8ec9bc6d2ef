"""The `hearth shard` process: load one layer range, connect, serve until SIGINT/SIGTERM, withdraw."""

from __future__ import annotations

import asyncio
import logging
import re
import socket

from events.subjects import shard_control_subject, shard_id_for
from inference import InferenceError, load_layer_range, weights_sha256
from inference.compute_thread import StepThreads, on_compute_thread
from services.common.config import HearthSettings, serve_shards_refused
from services.common.lifecycle import CommandRefused, unless_stopped
from services.common.metrics import serve_process_metrics
from services.common.nats_connection import connect_nats, drain_or_close
from services.shard.faults import ShardFault
from services.shard.compute import ShardCompute
from services.shard.server import ShardIdentity, ShardServer

log = logging.getLogger(__name__)

_layer_range_re = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


class ShardRefused(CommandRefused):
    """This host may not serve the asked range (its configuration forbids it, or it does not fit)."""


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


async def run_shard(
    *,
    model: str,
    layers: str,
    nats_url: str | None,
    node_id: str | None = None,
    model_id: str | None = None,
    settings: HearthSettings | None = None,
    max_streams: int | None = None,
    hop_weight: float = 1.0,
    dtype: str | None = None,
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
    host = settings.research.distributed_inference.host
    if serve_shards_refused(host):
        raise ShardRefused("this host's configuration says serve_shards = false")
    try:
        lo, hi = parse_layer_range(layers)
    except ValueError as error:
        raise ShardRefused(str(error)) from None
    configure_torch_threads(torch_threads)
    node = node_id or default_node_id()
    try:
        runner = await unless_stopped(
            on_compute_thread(load_layer_range, model, lo, hi, dtype=dtype, model_id=model_id), stop_event)
    except (InferenceError, ValueError) as error:
        first_line = (str(error).splitlines() or [""])[0]
        raise ShardRefused(f"cannot load layers {lo}-{hi} of {model}: {first_line}") from None
    info = runner.info
    digest = await unless_stopped(asyncio.to_thread(weights_sha256, info.path), stop_event)
    shard_id = shard_id_for(info.model_id, lo, hi, node)
    identity = ShardIdentity(
        shard_id=shard_id, model_id=info.model_id, node_id=node, weights_sha256=digest, layer_lo=lo,
        layer_hi=hi, total_layers=info.num_layers, dtype=info.dtype_name,
        memory_required_mb=round(runner.checkpoint_bytes_read / 2**20, 3),
        control_subject=shard_control_subject(node, shard_id),
    )
    if identity.memory_required_mb > host.shard_max_memory_mb:
        runner.close()
        raise ShardRefused(f"layers {lo}-{hi} need {identity.memory_required_mb:.0f} MB, more than "
                           f"shard_max_memory_mb = {host.shard_max_memory_mb:.0f} MB")
    server_ref: list[ShardServer] = []
    nc = await unless_stopped(connect_nats(
        nats_url, name=f"hearth-shard {shard_id}", settings=settings.nats,
        on_reconnected=lambda: server_ref[0].request_readvertise() if server_ref else None), stop_event)
    compute = ShardCompute(runner, shard_id, fault=ShardFault.parse(fault), step_threads=StepThreads(busy_threads),
                           range_layers=min(hi, info.num_layers - 1) - lo + 1)
    server = ShardServer(nc, compute, identity, settings, hop_weight=hop_weight)
    server_ref.append(server)
    metrics_server = None
    try:
        await server.start()
        metrics_server = serve_process_metrics(metrics_port, f"shard {shard_id}")
        print(f"shard {shard_id} ready (layers {lo}-{hi} of {info.num_layers}, weights {digest[:12]})", flush=True)
        if ready_file:
            with open(ready_file, "w") as handle:
                handle.write(shard_id)
        await stop_event.wait()
    finally:
        await server.stop("shutdown")
        if metrics_server is not None:
            metrics_server.stop()
        await drain_or_close(nc, settings.nats.drain_timeout_s)
        runner.close()
