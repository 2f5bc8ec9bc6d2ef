"""The short-lived broker connections that read a stored model (hearth host's manifest read, a shard's fetch) are
closed within `[nats] close_timeout_s`, as every other hearth connection is: a broker that stops answering just then
does not hold the host or shard up at start."""

from __future__ import annotations

import asyncio

from hearth.services import weights_store
from hearth.services.broker import connection
from hearth.services.common.config import HearthSettings
from hearth.services.host import model_layout


class _ConnectionWhoseCloseHangs:
    """A connection whose close waits for ever (its socket's buffer never drains)."""

    def jetstream(self):
        return object()

    async def close(self) -> None:
        await asyncio.Event().wait()


async def _connected(*args, **kwargs):
    return _ConnectionWhoseCloseHangs()


async def _read(js, name, *args):
    return f"read {name}"


async def test_the_hosts_manifest_read_ends_though_the_close_hangs(monkeypatch):
    monkeypatch.setattr(connection, "connect_nats", _connected)
    monkeypatch.setattr(model_layout, "read_manifest", _read)
    settings = HearthSettings(nats={"close_timeout_s": 0.05})

    done, _ = await asyncio.wait({asyncio.ensure_future(model_layout._store_manifest("m", None, settings))},
                                 timeout=5)

    assert [task.result() for task in done] == ["read m"]


async def test_a_shards_store_fetch_ends_though_the_close_hangs(monkeypatch):
    monkeypatch.setattr(connection, "connect_nats", _connected)
    monkeypatch.setattr(weights_store, "fetch_stored_model", _read)
    settings = HearthSettings(nats={"close_timeout_s": 0.05})

    fetching = asyncio.ensure_future(weights_store.resolve_model_source("store:m", None, nats_url=None,
                                                                        settings=settings))
    done, _ = await asyncio.wait({fetching}, timeout=5)

    assert [task.result() for task in done] == ["read m"]
