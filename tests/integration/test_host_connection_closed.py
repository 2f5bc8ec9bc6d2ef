"""A host (`hearth host`) whose own broker connection is closed for good stops, and its shard with it, instead of
staying up serving a range while blind to the holes it watches for (hearth/services/host/main.py, the watch on
until_stopped_or_closed)."""

from __future__ import annotations

import asyncio

import pytest

from hearth.services.broker import connection
from hearth.services.broker.connection import BrokerConnectionClosed
from hearth.services.common.config import load_settings
from hearth.services.host import main as host_main
from tests.integration.tiny_shard_server import MODEL

# Longer than nats-server's max_control_line (4 KiB).
oversized_subject_chars = 8000
ready_wait_s = 60.0


async def test_a_host_whose_connection_is_closed_for_good_stops(nats_server, tmp_path, monkeypatch):
    host_connections = []

    async def connect_and_keep(*args, **kwargs):
        nc = await connection.connect_nats(*args, **kwargs)
        host_connections.append(nc)
        return nc

    # The host's own connection (its coverage watch), not its shard's (hearth/services/shard/main.py makes that one).
    monkeypatch.setattr(host_main, "connect_nats", connect_and_keep)
    ready = tmp_path / "ready"
    stop_event = asyncio.Event()
    hosting = asyncio.create_task(host_main.run_host(
        model=str(MODEL), memory_budget_mb=None, nats_url=nats_server.url, settings=load_settings(), node_id="node0",
        ready_file=str(ready), stop_event=stop_event))
    try:
        async with asyncio.timeout(ready_wait_s):
            while not (ready.exists() or hosting.done()):
                await asyncio.sleep(0.05)
        assert ready.exists() and len(host_connections) == 1
        # The broker answers a control line past its limit by dropping the connection, and nats-py gives it up.
        await host_connections[0].subscribe("x" * oversized_subject_chars)
        with pytest.raises(BrokerConnectionClosed, match="closed for good"):
            await asyncio.wait_for(hosting, timeout=30)
        assert not stop_event.is_set()  # it stopped on its own
    finally:
        stop_event.set()
        hosting.cancel()
        await asyncio.gather(hosting, return_exceptions=True)
