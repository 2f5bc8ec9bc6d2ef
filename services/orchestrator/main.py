"""The `hearth orchestrator` process: connect, run the Orchestrator until SIGINT/SIGTERM, stop cleanly."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from services.common.config import HearthSettings
from services.common.nats_connection import connect_nats
from services.orchestrator.pipeline import PipelinePolicy
from services.orchestrator.service import Orchestrator, OrchestratorConfig

drain_timeout_s = 5.0


async def run_orchestrator(config: OrchestratorConfig, nats_url: str | None, *, preload: list[str] = (),
                           ready_file: str | None = None, stop_event: asyncio.Event) -> None:
    nc = await connect_nats(nats_url, name=f"hearth-orchestrator {config.node_id}")
    orchestrator = Orchestrator(nc, config)
    try:
        await orchestrator.start()
        for model in preload:
            await orchestrator.catalog.preload(model)
        print(f"orchestrator {config.node_id} ready", flush=True)
        if ready_file:
            with open(ready_file, "w") as handle:
                handle.write(config.node_id)
        await stop_event.wait()
    finally:
        await orchestrator.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.drain(), timeout=drain_timeout_s)


def config_from_settings(
    settings: HearthSettings,
    *,
    node_id: str,
    db_path: Path | None = None,
    local_model: str | None = None,
    model_search_dirs: list[Path] | None = None,
    step_timeout_s: float | None = None,
    busy_threads: int | None = None,
) -> OrchestratorConfig:
    """The orchestrator's configuration from the TOML/env settings plus command-line overrides."""
    research = settings.research
    distributed = research.distributed_inference
    policy = PipelinePolicy(
        step_timeout_s=step_timeout_s or settings.transport.step_timeout_s,
        gone_check_after_s=settings.transport.gone_check_after_s,
        fallback_to_local=distributed.fallback_to_local,
        fallback_to_local_after_failures=distributed.fallback_to_local_after_failures,
        wire_dtype=distributed.activation_dtype,
        window_chunks=settings.transport.window_chunks,
        chunk_bytes=settings.transport.chunk_bytes,
    )
    return OrchestratorConfig(
        node_id=node_id,
        db_path=db_path,
        enabled=research.enable and distributed.enabled,
        health_timeout_s=distributed.shard_health_timeout_seconds,
        allow_self_as_shard=distributed.allow_self_as_shard,
        max_shards_per_request=distributed.max_shards_per_request,
        max_concurrent_pipelines=distributed.max_concurrent_pipelines,
        policy=policy,
        model_search_dirs=list(model_search_dirs or []),
        local_model=local_model,
        busy_threads=busy_threads,
    )
