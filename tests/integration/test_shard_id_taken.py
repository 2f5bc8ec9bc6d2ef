"""One shard id, one process: a shard starting under an id another live process serves (same node, range and scheme)
refuses in one line instead of sharing its subjects, while one whose earlier run is gone starts."""

from __future__ import annotations

import pytest

from hearth.services.broker.connection import connect_nats
from hearth.services.common.config import load_settings
from hearth.services.common.lifecycle import CommandRefused
from hearth.services.shard.compute import ShardCompute
from hearth.services.shard.server import ShardServer
from tests.integration.tiny_shard_server import tiny_shard_server


async def test_a_second_process_under_a_served_shard_id_refuses_to_start(nats_server):
    settings = load_settings()
    async with tiny_shard_server(nats_server.url) as first:
        twin_nc = await connect_nats(nats_server.url, name="twin-shard", settings=settings.nats)
        twin = ShardServer(twin_nc, ShardCompute(first.runner, "tiny-0-1", settings.shard), first.server.identity,
                           settings)
        try:
            with pytest.raises(CommandRefused, match="tiny-0-1 is already served by another process") as refused:
                await twin.start()
            assert "\n" not in str(refused.value)
        finally:
            await twin_nc.close()
        assert first.server.active_streams == 0 and first.server._control_sub is not None
    # The first one gone (its subscription with it), the id is free again.
    async with tiny_shard_server(nats_server.url) as again:
        assert again.server._control_sub is not None
