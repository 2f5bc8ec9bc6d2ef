"""An orchestrator's --local-model that must be fetched first (`store:NAME`, a hub id not in the local cache) is
fetched in the background from the start and listed (and run as the local fallback) only once it has arrived; a
failed fetch is one warning line, and the next fallback tries again."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from hearth.services.orchestrator.catalog import ModelCatalog
from hearth.services.weights_store import WeightsStoreError


async def test_a_stored_local_model_is_listed_only_once_it_has_arrived(tmp_path):
    arrived, asked = asyncio.Event(), []

    async def slow_fetch(name, needed):
        asked.append((name, needed))
        await asyncio.wait_for(arrived.wait(), timeout=10)
        return tmp_path

    catalog = ModelCatalog(local_model="store:big-model")
    catalog._store_fetch = slow_fetch
    assert catalog.local_model_id() is None  # nothing fetched yet: a call routed to it could not be answered
    await catalog.start_local_fetch()
    await asyncio.sleep(0)
    assert asked == [("big-model", None)] and catalog.local_model_id() is None
    assert await asyncio.wait_for(catalog.local_model_for(loaded=None), timeout=5) is None  # no wait on the fetch
    arrived.set()
    await asyncio.wait_for(catalog.local.fetch.folder_at_hand(wait=True), timeout=10)
    assert catalog.local_model_id() == "big-model" and asked == [("big-model", None)]
    catalog.close()


async def test_a_failed_fetch_is_one_warning_line_and_the_next_fallback_tries_again(tmp_path, caplog):
    tries = []

    async def unreachable(name, needed):
        tries.append(name)
        if len(tries) == 1:
            raise WeightsStoreError(f"no model {name!r} in the community's store")
        return tmp_path

    catalog = ModelCatalog(local_model="store:big-model")
    catalog._store_fetch = unreachable
    with caplog.at_level(logging.WARNING):
        await catalog.start_local_fetch()
        await asyncio.wait_for(catalog.local.fetch.start(), timeout=10)  # the fetch started from the start
    [warning] = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warning.startswith("--local-model store:big-model could not be fetched") and "\n" not in warning
    assert catalog.local_model_id() is None
    assert await asyncio.wait_for(catalog.local.fetch.folder_at_hand(wait=True), timeout=10) == Path(tmp_path)
    assert catalog.local_model_id() == "big-model" and len(tries) == 2
    catalog.close()


async def test_a_hub_local_model_not_in_the_local_cache_is_fetched_whole_and_then_listed(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fetched, arrived = [], asyncio.Event()

    async def fetch_hub(model, needed):
        fetched.append(needed)
        await asyncio.wait_for(arrived.wait(), timeout=10)
        catalog._hub_folders.setdefault(model, {})[needed] = tmp_path
        return tmp_path

    catalog = ModelCatalog(local_model="nobody-here/not-in-the-hub-cache")
    monkeypatch.setattr(catalog, "_fetch_hub", fetch_hub)
    await catalog.start_local_fetch()
    await asyncio.sleep(0.1)
    assert fetched == [None] and catalog.local_model_id() is None
    arrived.set()
    await asyncio.wait_for(catalog.local.fetch.folder_at_hand(wait=True), timeout=10)
    assert catalog.local_model_id() == "nobody-here/not-in-the-hub-cache"
    catalog.close()


def test_a_hub_download_under_way_does_not_hold_up_the_end_of_the_process(monkeypatch, tmp_path):
    """An orchestrator that fails to start (a --preload refused) while its --local-model downloads in the background
    ends at once: the download (a blocking call, gigabytes) must not keep asyncio.run or the interpreter waiting."""
    import threading
    import time

    import hearth.services.orchestrator.catalog as catalog_module
    from hearth.inference.errors import CheckpointError

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    downloading, finish = threading.Event(), threading.Event()

    def slow_download(model, needed_layers=None, local_files_only=False):
        if local_files_only:
            raise CheckpointError("not in the local hub cache")
        downloading.set()
        finish.wait(timeout=20)
        raise CheckpointError("cut short")

    monkeypatch.setattr(catalog_module, "resolve_model_path", slow_download)

    async def start_that_fails() -> None:
        catalog = ModelCatalog(local_model="nobody-here/a-big-model")
        await catalog.start_local_fetch()
        assert await asyncio.to_thread(downloading.wait, 10)
        catalog.close()  # as orchestrator.stop() does before the command's refusal

    began = time.monotonic()
    try:
        asyncio.run(start_that_fails())
        ended_s = time.monotonic() - began
    finally:
        finish.set()
    assert ended_s < 5
