"""The `hearth orchestrator` process: connect, run the Orchestrator until SIGINT/SIGTERM, stop cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import signal

from services.common.nats_connection import connect_nats
from services.orchestrator.service import Orchestrator, OrchestratorConfig

drain_timeout_s = 5.0


async def run_orchestrator(config: OrchestratorConfig, nats_url: str | None, *, preload: list[str] = (),
                           ready_file: str | None = None) -> None:
    nc = await connect_nats(nats_url, name=f"hearth-orchestrator {config.node_id}")
    orchestrator = Orchestrator(nc, config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await orchestrator.start()
        for model in preload:
            await orchestrator.catalog.preload(model)
        print(f"orchestrator {config.node_id} ready", flush=True)
        if ready_file:
            with open(ready_file, "w") as handle:
                handle.write(config.node_id)
        await stop.wait()
    finally:
        await orchestrator.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.drain(), timeout=drain_timeout_s)
