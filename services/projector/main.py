"""The long-running projector process: keeps a SQLite read model up to date from JetStream, with metrics."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from readmodels.runner import Projector
from services.common.metrics import default_metrics_host, start_metrics_server
from services.common.nats_connection import connect_nats
from services.projector.metrics import ProjectorCollector

__all__ = ["Projector", "run_projector", "main"]

log = logging.getLogger(__name__)

connect_retry_max_wait_s = 5.0
drain_timeout_s = 5.0


async def run_projector(
    db_path: str | Path,
    nats_url: str | None,
    metrics_port: int | None = None,
    *,
    stop_event: asyncio.Event | None = None,
    registry: CollectorRegistry = REGISTRY,
    metrics_host: str = default_metrics_host,
) -> None:
    """Run until `stop_event` is set (or forever): migrate `db_path`, follow both streams, serve /metrics.

    A broker that is down at start is waited for; once connected, broker restarts are survived by the
    connection's reconnects and the reader's consumer recreation, resuming from the stored positions.
    """
    stop_event = stop_event or asyncio.Event()
    nc = None
    async for attempt in AsyncRetrying(
        retry=retry_if_exception_type(Exception),
        wait=wait_exponential(multiplier=0.2, max=connect_retry_max_wait_s),
    ):
        with attempt:
            if stop_event.is_set():
                return
            nc = await connect_nats(nats_url, name="hearth-projector")
    projector = Projector(db_path, nc.jetstream())
    collector = ProjectorCollector(projector)
    metrics_server = None
    try:
        await projector.start()
        registry.register(collector)
        if metrics_port is not None:
            metrics_server = start_metrics_server(metrics_port, host=metrics_host, registry=registry)
        await stop_event.wait()
    finally:
        if metrics_server is not None:
            metrics_server.stop()
        try:
            registry.unregister(collector)
        except KeyError:
            pass  # start() failed before it was registered
        await projector.stop()
        try:
            await asyncio.wait_for(nc.drain(), timeout=drain_timeout_s)
        except Exception as error:  # closing anyway; the broker may be gone
            log.debug("projector: draining the NATS connection failed: %s", error)
            await nc.close()


def main(db: Path, nats_url: str | None = None, metrics_port: int | None = None) -> None:
    """Entry point for `python -m services.projector`: runs until SIGTERM/SIGINT, then stops cleanly."""
    from services.common.lifecycle import run_until_stopped
    from services.common.logging import configure_logging

    configure_logging()
    run_until_stopped(lambda stop_event: run_projector(db, nats_url, metrics_port, stop_event=stop_event))
