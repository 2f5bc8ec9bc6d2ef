"""A `hearth host` stopped (SIGTERM) while it reads the mesh before choosing its layers stops at once, through its
own shutdown (projector stopped, connection drained): before, it went on waiting for its read model to catch up
(`[orchestrator] start_catch_up_timeout_s`, 30 s by default) and the stop deadline killed it mid-way. About one run
in ten then also waited 10 s for the projector to stop: its poll of the stream's state (asyncio.wait_for, Python
3.11) had swallowed the cancellation (hearth/readmodels/runner.py waits with asyncio.timeout now)."""

from __future__ import annotations

import asyncio

import pytest

import hearth.services.host.main as host_main
from hearth.services.common.config import HearthSettings
from hearth.services.common.lifecycle import Stopped
from tests.integration.tiny_shard_server import MODEL

CATCH_UP_S = 60.0


async def test_a_host_stopped_while_its_read_model_catches_up_stops_at_once(nats_server, monkeypatch):
    catching_up = asyncio.Event()

    async def long_catch_up(projector, timeout_s, *, going_on):  # a long event log, read from its start
        catching_up.set()
        await asyncio.sleep(timeout_s)
        return False

    monkeypatch.setattr(host_main, "read_model_caught_up", long_catch_up)
    settings = HearthSettings()
    settings = settings.model_copy(update={"orchestrator": settings.orchestrator.model_copy(
        update={"start_catch_up_timeout_s": CATCH_UP_S})})
    stop_event = asyncio.Event()
    host = asyncio.create_task(host_main.run_host(
        model=str(MODEL), memory_budget_mb=None, nats_url=nats_server.url, settings=settings, node_id="n1",
        device="cpu", stop_event=stop_event))
    try:
        await asyncio.wait_for(catching_up.wait(), timeout=60)
        stop_event.set()
        with pytest.raises(Stopped):
            await asyncio.wait_for(host, timeout=10)
    finally:
        host.cancel()
        await asyncio.gather(host, return_exceptions=True)
