"""A ShardServer of the bundled tiny model's layers 0-1 on a test's nats-server, and a client connection to it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from nats.aio.client import Client as NatsClient

from hearth.inference import load_layer_range
from hearth.inference.compute_thread import on_compute_thread
from hearth.inference.runner import LayerRangeRunner
from hearth.protocol.subjects import shard_control_subject
from hearth.services.broker.connection import connect_nats
from hearth.services.common.config import load_settings
from hearth.services.shard.compute import ShardCompute
from hearth.services.shard.server import ShardIdentity, ShardServer
from tests.runner_limits import RUNNER_KV_LIMITS

MODEL = Path(__file__).resolve().parents[2] / "models" / "hearth-tiny-llama"
# Its max_position_embeddings: a shard refuses an `open` whose max_session_tokens goes beyond it.
CONTEXT = 512


@dataclass
class TinyShard:
    server: ShardServer
    runner: LayerRangeRunner
    client: NatsClient  # an orchestrator's stand-in
    subject: str  # the shard's control subject


@contextlib.asynccontextmanager
async def tiny_shard_server(nats_url: str, *, prefix_ttl_s: float | None = None,
                            outbox_dir: Path | None = None,
                            cache_budget_bytes: int | None = None) -> AsyncIterator[TinyShard]:
    """Started (keeping ended sessions' blocks for `prefix_ttl_s` when given; its withdrawals kept in `outbox_dir` until
    stored when given; its sessions' KV caches within `cache_budget_bytes` when given, else the configured default);
    stopped, its connections closed and its runner closed on exit."""
    limits = {**RUNNER_KV_LIMITS, **({} if cache_budget_bytes is None else {"cache_budget_bytes": cache_budget_bytes})}
    runner = await on_compute_thread(load_layer_range, MODEL, 0, 1, prefix_ttl_s=prefix_ttl_s, **limits)
    settings = load_settings()
    nc = await connect_nats(nats_url, name="shard-under-test", settings=settings.nats)
    client = await connect_nats(nats_url, name="orchestrator-stand-in", settings=settings.nats)
    subject = shard_control_subject("node0", "tiny-0-1")
    server = ShardServer(nc, ShardCompute(runner, "tiny-0-1", settings.shard), ShardIdentity(
        shard_id="tiny-0-1", model_id="tiny", node_id="node0", weights_sha256="0" * 64, layer_lo=0, layer_hi=1,
        total_layers=runner.info.num_layers, dtype="float32", memory_required_mb=1.0, control_subject=subject),
        settings, **({} if outbox_dir is None else {"outbox_dir": outbox_dir}))
    try:
        await server.start()
        yield TinyShard(server, runner, client, subject)
    finally:
        await server.stop()
        await client.close()
        await nc.close()
        runner.close()
