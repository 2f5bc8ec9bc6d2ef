"""`hearth host` whose own coverage read model SQLite finds damaged rebuilds it from the event log
(hearth/readmodels/scratch_model.py): the file is purely derived and only the host reads it, so it is moved
aside with one WARNING line and the host's view moves on (and a disk that damages every file ends the host in one
line). Before, its projector stopped applying (one ERROR line)
and the host went on choosing layers on a view that no longer moved."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
import torch

from hearth.inference.memory import MiB, layer_weight_bytes
from hearth.services.broker.connection import close_quietly, connect_nats
from hearth.services.common.config import load_settings
from hearth.readmodels import scratch_model
from hearth.readmodels.scratch_model import ScratchModelGivenUp
from hearth.services.host.coverage import COVERAGE_FILE, coverage_model
from hearth.services.host import main as host_main
from tests.integration.tiny_shard_server import MODEL
from tests.readmodel_helpers import keys_in, with_a_damaged_table

KV_RESERVE_MB = 0.02
wait_s = 60.0


async def test_a_host_rebuilds_its_damaged_coverage_read_model_and_its_view_moves_on(
        nats_server, tmp_path, monkeypatch, caplog):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    # Damaged where the start does not read: found when the host's own advert is applied.
    with_a_damaged_table(scratch / COVERAGE_FILE, "applied_events")
    monkeypatch.setattr(host_main, "ScratchFolder", lambda prefix: contextlib.nullcontext(scratch))
    monkeypatch.setenv("HEARTH_SHARD__KV_CACHE_BUDGET_MB", str(KV_RESERVE_MB))
    layer = max(layer_weight_bytes(MODEL, torch.float32).values())
    ready = tmp_path / "ready"
    stop_event = asyncio.Event()
    hosting = asyncio.create_task(host_main.run_host(
        model=str(MODEL), memory_budget_mb=KV_RESERVE_MB + 1.5 * layer / MiB, nats_url=nats_server.url,
        settings=load_settings(), node_id="node0", device="cpu", ready_file=str(ready), stop_event=stop_event))
    rebuilt = scratch / "coverage-1.sqlite"
    moved_aside = scratch / f"{COVERAGE_FILE}.damaged"
    try:
        with caplog.at_level(logging.WARNING):
            async with asyncio.timeout(wait_s):
                # Until the damaged file is moved aside too: that comes once the rebuilt view has caught up.
                while not (ready.exists() and rebuilt.exists() and keys_in(rebuilt, "shards", "shard_id")
                           and moved_aside.exists()) and not hosting.done():
                    await asyncio.sleep(0.05)
        assert not hosting.done(), hosting  # the host serves on
        shard_id = ready.read_text()
        assert keys_in(rebuilt, "shards", "shard_id") == [shard_id]  # its view moved on: its own advert is in it
        assert moved_aside.exists()
        said = [record for record in caplog.records if "coverage" in record.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.WARNING, said  # one line says it, not an ERROR
        assert "rebuilding it from the event log" in said[0].getMessage() and "\n" not in said[0].getMessage()
    finally:
        stop_event.set()
        await asyncio.wait_for(asyncio.gather(hosting, return_exceptions=True), timeout=30)


async def test_a_file_damaged_as_it_starts_is_rebuilt_and_a_disk_that_damages_every_one_ends_the_host(
        nats_server, tmp_path, monkeypatch):
    nc = await connect_nats(nats_server.url, name="host-coverage")
    try:
        scratch = tmp_path / "scratch"
        scratch.mkdir()
        (scratch / COVERAGE_FILE).write_bytes(b"\x07" * 4096)  # its header torn: found as it starts
        view = await coverage_model(scratch, nc.jetstream(), load_settings()).start()
        try:
            assert view.projector.db_path.name == "coverage-1.sqlite"
            assert (scratch / f"{COVERAGE_FILE}.damaged").exists()
            await view.wait_until_caught_up(timeout_s=wait_s)
        finally:
            await view.stop()

        monkeypatch.setattr(scratch_model, "max_rebuilds", 0)
        (scratch / COVERAGE_FILE).write_bytes(b"\x07" * 4096)
        with pytest.raises(ScratchModelGivenUp) as refused:
            await coverage_model(scratch, nc.jetstream(), load_settings()).start()
        assert "\n" not in str(refused.value) and "coverage read model" in str(refused.value)
    finally:
        await close_quietly(nc)
