"""`hearth orchestrator` without --db whose scratch routing read model SQLite finds damaged rebuilds it from the event
log (hearth/readmodels/scratch_model.py), as `hearth host` does its coverage: the file is purely derived and only this
process reads it, so one WARNING line says so, the damaged file is moved aside and the orchestrator serves on. Before,
it ended in one line beginning "--db", though nobody had given a --db."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from hearth.events.publish import publish_event
from hearth.services.common.config import load_settings
from hearth.services.orchestrator import service
from hearth.services.orchestrator.main import OrchestratorOptions, run_orchestrator
from tests.event_streams import jetstream_with_streams
from tests.readmodel_helpers import constructed, keys_in, with_a_damaged_table

pytestmark = pytest.mark.integration

wait_s = 30.0


async def test_an_orchestrator_rebuilds_its_damaged_scratch_routing_read_model_and_serves_on(
        nats_server, tmp_path, monkeypatch, caplog):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    # Damaged where the start does not read: found when a call's event is applied.
    with_a_damaged_table(scratch / service.ROUTING_FILE, "pipelines")
    monkeypatch.setattr(service, "ScratchFolder", lambda prefix: SimpleNamespace(path=scratch, cleanup=lambda: None))
    ready = tmp_path / "ready"
    stop_event = asyncio.Event()
    serving = asyncio.create_task(run_orchestrator(
        load_settings(), OrchestratorOptions(node_id="orch-scratch"), nats_server.url, ready_file=str(ready),
        stop_event=stop_event))
    rebuilt = scratch / "routing-1.sqlite"
    moved_aside = scratch / f"{service.ROUTING_FILE}.damaged"
    try:
        async with asyncio.timeout(wait_s):
            while not ready.exists() and not serving.done():
                await asyncio.sleep(0.05)
        with caplog.at_level(logging.WARNING):
            async with jetstream_with_streams(nats_server.url, "test-damaged-routing") as js:
                await publish_event(js, constructed("p1", ["m:0-3@a"]))
            async with asyncio.timeout(wait_s):
                # Until the damaged file is moved aside too: that comes once the rebuilt view has caught up.
                while not (rebuilt.exists() and keys_in(rebuilt, "pipelines", "pipeline_id") and moved_aside.exists()) \
                        and not serving.done():
                    await asyncio.sleep(0.05)
        assert not serving.done(), serving  # it serves on, rather than ending "--db ..."
        assert keys_in(rebuilt, "pipelines", "pipeline_id") == ["p1"]  # its view moved on: the call's event is in it
        assert moved_aside.exists()
        said = [record for record in caplog.records if "routing read model" in record.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.WARNING, said  # one line says it, not an ERROR
        assert "rebuilding it from the event log" in said[0].getMessage() and "\n" not in said[0].getMessage()
    finally:
        stop_event.set()
        await asyncio.wait_for(asyncio.gather(serving, return_exceptions=True), timeout=30)
