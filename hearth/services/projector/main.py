"""The long-running projector process: keeps a SQLite read model up to date from JetStream, with metrics."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry

from hearth.events.signing import EventVerifier
from hearth.readmodels.db import ReadModelUnusable
from hearth.readmodels.retention import retention_policy
from hearth.readmodels.runner import Projector
from hearth.services.common.config import NatsSettings, ReadModelSettings
from hearth.services.common.config_sections import MetricsSettings
from hearth.services.common.event_trust import stream_setup
from hearth.services.common.lifecycle import CommandRefused, Stopped, unless_stopped, write_ready_file
from hearth.services.common.metrics import serve_process_metrics
from hearth.services.broker.connection import close_quietly, connect_nats, drain_or_close
from hearth.services.projector.metrics import ProjectorCollector

__all__ = ["Projector", "run_projector", "main"]

log = logging.getLogger(__name__)

# Stopping the followers normally takes milliseconds; a follower that missed its cancellation (a wait_for inside
# nats-py can swallow one on Python 3.11) is cancelled again when this runs out, so a stop stays inside the deadline.
projector_stop_timeout_s = 1.0


async def run_projector(
    db_path: str | Path,
    nats_url: str | None,
    metrics_port: int | None = None,
    *,
    stop_event: asyncio.Event | None = None,
    registry: CollectorRegistry = REGISTRY,
    metrics_host: str | None = None,
    nats_settings: NatsSettings | None = None,
    verifier: EventVerifier | None = None,
    ready_file: str | Path | None = None,
    readmodel_settings: ReadModelSettings | None = None,
) -> None:
    """Run until `stop_event` is set (or forever): migrate `db_path`, follow both streams, serve /metrics.
    With a `verifier` (the community's roster) only events that pass it are applied; the others are kept in
    rejected_events and counted in `hearth_events_rejected_total`. `ready_file` is written once the database
    is migrated and both streams are followed (what `hearth demo` waits for before its first call). History is
    pruned as `readmodel_settings` say ([readmodels]; its defaults when None).

    A broker that is down at start is waited for as `nats_settings` say (connect_timeout_s, then
    BrokerUnreachable; or wait_for_broker); once connected, broker restarts are survived by the
    connection's reconnects and the reader's consumer recreation, resuming from the stored positions.
    """
    stop_event = stop_event or asyncio.Event()
    settings = nats_settings or NatsSettings()
    try:
        nc = await unless_stopped(connect_nats(nats_url, name="hearth-projector", settings=settings),
                                  stop_event)
    except Stopped:
        return
    retention = retention_policy(readmodel_settings or ReadModelSettings())
    projector = Projector(db_path, nc.jetstream(), verifier=verifier, stream_setup=stream_setup(settings),
                          retention=retention)
    collector = ProjectorCollector(projector)
    metrics_server = None
    try:
        try:
            await projector.start()
        except ReadModelUnusable as error:  # one line and exit 1, the file left as it was
            raise CommandRefused(str(error)) from None
        registry.register(collector)
        metrics_server = serve_process_metrics(metrics_port, "projector", host=metrics_host or MetricsSettings().host,
                                               registry=registry)
        if ready_file:
            write_ready_file(ready_file, "projector")
        try:  # until stopped, or until the file is found damaged: then one line and exit 1, for a rebuild
            await unless_stopped(projector.found_unusable.wait(), stop_event)
        except Stopped:
            return
        raise CommandRefused(str(projector.unusable))
    finally:
        if metrics_server is not None:
            metrics_server.stop()
        try:
            registry.unregister(collector)
        except KeyError:
            pass  # start() failed before it was registered
        if not nc.is_connected:
            # The broker is gone: closing first spares the stop waiting for it to delete the consumers.
            await close_quietly(nc, settings.close_timeout_s)
        try:
            async with asyncio.timeout(projector_stop_timeout_s):
                await projector.stop()
        except TimeoutError:
            log.debug("projector: stopping the followers took over %.1f s", projector_stop_timeout_s)
        await drain_or_close(nc, settings.drain_timeout_s)



def main(db: Path, nats_url: str | None = None, metrics_port: int = 0) -> None:
    """Entry point for `python -m hearth.services.projector`: runs until SIGTERM/SIGINT, then stops cleanly."""
    from hearth.services.common.config import load_settings
    from hearth.services.common.event_trust import event_verifier
    from hearth.services.common.lifecycle import run_until_stopped
    from hearth.services.common.logging import configure_logging

    configure_logging()
    settings = load_settings()
    verifier = event_verifier(settings)
    run_until_stopped(lambda stop_event: run_projector(db, nats_url, metrics_port, stop_event=stop_event,
                                                       nats_settings=settings.nats, verifier=verifier,
                                                       readmodel_settings=settings.readmodels))
