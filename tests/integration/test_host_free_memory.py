"""`hearth host` on a machine with less free memory than its budget plans with what is free (and says so): it chose
by the budget alone, took layers the device could not hold, and was killed loading them (and again on every
restart, as it chose the same layers)."""

from __future__ import annotations

import asyncio
import logging

import torch

from hearth.inference.memory import MiB, layer_weight_bytes
from hearth.services.common.config import load_settings
from hearth.services.host import main as host_main
from tests.integration.tiny_shard_server import MODEL

KV_RESERVE_MB = 0.02
ready_wait_s = 60.0


async def test_a_host_with_less_free_memory_than_its_budget_takes_the_layers_that_fit_what_is_free(
        nats_server, tmp_path, monkeypatch, caplog):
    layer = max(layer_weight_bytes(MODEL, torch.float32).values())
    monkeypatch.setenv("HEARTH_SHARD__KV_CACHE_BUDGET_MB", str(KV_RESERVE_MB))
    budget_mb = KV_RESERVE_MB + 2.5 * layer / MiB  # two layers
    free_bytes = int(KV_RESERVE_MB * MiB + 1.5 * layer)  # one layer
    monkeypatch.setattr(host_main, "device_memory_available_bytes", lambda device: free_bytes, raising=False)
    ready = tmp_path / "ready"
    stop_event = asyncio.Event()
    hosting = asyncio.create_task(host_main.run_host(
        model=str(MODEL), memory_budget_mb=budget_mb, nats_url=nats_server.url, settings=load_settings(),
        node_id="node0", device="cpu", ready_file=str(ready), stop_event=stop_event))
    try:
        with caplog.at_level(logging.WARNING, logger=host_main.__name__):
            async with asyncio.timeout(ready_wait_s):
                while not (ready.exists() or hosting.done()):
                    await asyncio.sleep(0.05)
        assert ready.exists(), hosting
        assert ready.read_text().endswith(":0-0@node0")
        assert f"more than the {free_bytes / MiB:.1f} MB free" in caplog.text
    finally:
        stop_event.set()
        await asyncio.wait_for(asyncio.gather(hosting, return_exceptions=True), timeout=30)
