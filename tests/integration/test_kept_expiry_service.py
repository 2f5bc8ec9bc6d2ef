"""A started orchestrator expires its kept prefixes' memory at its shards' `prefix_cache_idle_s` (as its settings give
it) by a sweep its task set owns, which its stop cancels (hearth/services/orchestrator/kept_expiry.py)."""

from __future__ import annotations

import nats
import pytest

from hearth.services.common.config import HearthSettings
from hearth.services.orchestrator.service import Orchestrator

pytestmark = pytest.mark.integration


async def test_the_orchestrator_sweeps_kept_memory_at_its_shards_idle_time_until_stopped(nats_server):
    nc = await nats.connect(nats_server.url)
    settings = HearthSettings(nats={"url": nats_server.url}, shard={"prefix_cache_idle_s": 42})
    orchestrator = Orchestrator(nc, settings, node_id="orch-1")
    try:
        await orchestrator.start()
        context = orchestrator.context
        assert context.kept_inputs._expiry.idle_s == 42 and context.kept_chains._expiry.idle_s == 42
        (sweep,) = [task for task in orchestrator._tasks if task.get_name() == "kept-prefix-sweep"]
        assert not sweep.done()
    finally:
        await orchestrator.stop()
        await nc.close()
    assert sweep.cancelled()
