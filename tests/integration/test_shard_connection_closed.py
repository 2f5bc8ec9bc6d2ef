"""A shard is never left running unreachable: an `open` naming a hop beyond a pipeline's bound is refused before any
subject is built from it (a hop number of thousands of digits made the shard subscribe past the broker's control
line, and the broker dropped its connection), and a shard whose connection nats-py closed for good stops with one
line instead of staying up advertised but deaf; so does a host (`hearth host`) whose own connection is closed for
good, its shard with it, instead of serving a range while blind to the holes it watches for."""

from __future__ import annotations

import asyncio
import json

import pytest

from hearth.inference import load_layer_range
from hearth.inference.compute_thread import on_compute_thread
from hearth.protocol.control import ControlReply, ShardStat, StatShard
from hearth.protocol.mesh_protocol import MESH_PROTOCOL
from hearth.protocol.subjects import shard_control_subject
from hearth.services.broker import connection
from hearth.services.broker.connection import BrokerConnectionClosed
from hearth.services.common.config import load_settings
from hearth.services.host import main as host_main
from hearth.services.shard import main as shard_main
from hearth.services.shard.main import LoadedShard, serve_loaded_shard
from hearth.services.shard.server import ShardIdentity
from tests.integration.tiny_shard_server import MODEL, tiny_shard_server
from tests.runner_limits import RUNNER_KV_LIMITS

reply_timeout_s = 5.0
# Longer than nats-server's max_control_line (4 KiB).
oversized_subject_chars = 8000
ready_wait_s = 60.0


def kept_connections(monkeypatch, module) -> list:
    """The broker connections `module` makes through its `connect_nats`, kept as they are made."""
    connections = []

    async def connect_and_keep(*args, **kwargs):
        nc = await connection.connect_nats(*args, **kwargs)
        connections.append(nc)
        return nc

    monkeypatch.setattr(module, "connect_nats", connect_and_keep)
    return connections


async def close_for_good(nc) -> None:
    """The broker answers a control line past its limit by dropping the connection, and nats-py gives it up."""
    await nc.subscribe("x" * oversized_subject_chars)


async def test_an_open_naming_a_huge_hop_is_refused_and_the_shard_stays_reachable(nats_server):
    async with tiny_shard_server(nats_server.url) as shard:
        hop = 10 ** 4000
        request = dict(op="open", pipeline_id="p" * 128, session_id="s", hop=hop, hop_count=hop + 1,
                       model_id="tiny", weights_sha256="0" * 64, layer_lo=0, layer_hi=1, protocol=MESH_PROTOCOL)
        message = await shard.client.request(shard.subject, json.dumps(request).encode(), timeout=reply_timeout_s)
        reply = ControlReply.model_validate_json(message.data)
        assert (reply.ok, reply.code) == (False, "bad_request") and "\n" not in reply.message
        assert "open.hop" in reply.message and "0000" not in reply.message
        stat = await shard.client.request(shard.subject, StatShard().model_dump_json().encode(),
                                          timeout=reply_timeout_s)
        assert ShardStat.model_validate_json(stat.data).open_pipelines == []
        assert shard.server.nc.is_connected


async def test_a_shard_whose_connection_is_closed_for_good_stops_with_one_line(nats_server, tmp_path, monkeypatch):
    runner = await on_compute_thread(load_layer_range, MODEL, 0, 1, **RUNNER_KV_LIMITS)
    identity = ShardIdentity(
        shard_id="tiny-0-1", model_id="tiny", node_id="node0", weights_sha256="0" * 64, layer_lo=0, layer_hi=1,
        total_layers=runner.info.num_layers, dtype="float32", memory_required_mb=1.0,
        control_subject=shard_control_subject("node0", "tiny-0-1"))
    connections = kept_connections(monkeypatch, shard_main)
    ready = tmp_path / "ready"
    serving = asyncio.create_task(serve_loaded_shard(
        LoadedShard(runner, identity), nats_url=nats_server.url, settings=load_settings(), ready_file=str(ready),
        stop_event=asyncio.Event()))
    try:
        for _ in range(200):
            if ready.exists() or serving.done():
                break
            await asyncio.sleep(0.05)
        assert ready.exists()
        await close_for_good(connections[0])
        with pytest.raises(BrokerConnectionClosed, match="closed for good"):
            await asyncio.wait_for(serving, timeout=30)
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


async def test_a_host_whose_connection_is_closed_for_good_stops(nats_server, tmp_path, monkeypatch):
    # The host's own connection (its coverage watch), not its shard's (hearth/services/shard/main.py makes that one).
    host_connections = kept_connections(monkeypatch, host_main)
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
        await close_for_good(host_connections[0])
        with pytest.raises(BrokerConnectionClosed, match="closed for good"):
            await asyncio.wait_for(hosting, timeout=30)
        assert not stop_event.is_set()  # it stopped on its own
    finally:
        stop_event.set()
        hosting.cancel()
        await asyncio.gather(hosting, return_exceptions=True)
