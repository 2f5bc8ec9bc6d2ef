"""The `hearth shard` process: load one layer range, connect, serve until SIGINT/SIGTERM, withdraw."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket

from events.subjects import shard_control_subject, shard_id_for
from inference import load_layer_range, weights_sha256
from services.common.compute import StepThreads, on_compute_thread
from services.common.metrics import start_metrics_server
from services.common.nats_connection import connect_nats
from services.shard.faults import ShardFault
from services.shard.server import ShardIdentity, ShardServer, advertisement_ttl_s, heartbeat_interval_s

log = logging.getLogger(__name__)

drain_timeout_s = 5.0
_layer_range_re = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


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
    max_streams: int = 4,
    hop_weight: float = 1.0,
    dtype: str | None = None,
    heartbeat_s: float = heartbeat_interval_s,
    ttl_s: float = advertisement_ttl_s,
    fault: str | None = None,
    torch_threads: int | None = None,
    busy_threads: int | None = None,
    ready_file: str | None = None,
    window_chunks: int = 16,
    chunk_bytes: int | None = None,
    metrics_port: int | None = None,
    stop_event: asyncio.Event,
) -> None:
    lo, hi = parse_layer_range(layers)
    configure_torch_threads(torch_threads)
    node = node_id or default_node_id()
    runner = await on_compute_thread(load_layer_range, model, lo, hi, dtype=dtype, model_id=model_id)
    info = runner.info
    digest = await asyncio.to_thread(weights_sha256, info.path)
    shard_id = shard_id_for(info.model_id, lo, hi, node)
    identity = ShardIdentity(
        shard_id=shard_id, model_id=info.model_id, node_id=node, weights_sha256=digest, layer_lo=lo,
        layer_hi=hi, total_layers=info.num_layers, dtype=info.dtype_name,
        memory_required_mb=round(runner.checkpoint_bytes_read / 2**20, 3),
        control_subject=shard_control_subject(node, shard_id),
    )
    server_ref: list[ShardServer] = []
    nc = await connect_nats(nats_url, name=f"hearth-shard {shard_id}",
                            on_reconnected=lambda: server_ref[0].request_readvertise() if server_ref else None)
    server = ShardServer(nc, runner, identity, max_concurrent_streams=max_streams, hop_weight=hop_weight,
                         heartbeat_interval_s=heartbeat_s, ttl_s=ttl_s, fault=ShardFault.parse(fault),
                         window_chunks=window_chunks, chunk_bytes=chunk_bytes,
                         step_threads=StepThreads(busy_threads))
    server_ref.append(server)
    metrics_server = None
    try:
        await server.start()
        if metrics_port is not None:
            metrics_server = start_metrics_server(metrics_port)
            print(f"shard {shard_id} metrics on {metrics_server.url}", flush=True)
        print(f"shard {shard_id} ready (layers {lo}-{hi} of {info.num_layers}, weights {digest[:12]})", flush=True)
        if ready_file:
            with open(ready_file, "w") as handle:
                handle.write(shard_id)
        await stop_event.wait()
    finally:
        await server.stop("shutdown")
        if metrics_server is not None:
            metrics_server.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.drain(), timeout=drain_timeout_s)
        runner.close()
