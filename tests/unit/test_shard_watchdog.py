"""A shard's watchdog keeps closing expired hops and evicting idle sessions though one close (or one eviction) fails:
the failure is logged by its type and traceback, never its message, and the next hop and the next round go on. With
no hop open it waits for one rather than going round."""

from __future__ import annotations

import asyncio
import logging

from hearth.services.common.config import HearthSettings
from hearth.services.shard.identity import ShardIdentity
from hearth.services.shard.server import ShardServer

# What a runner's error could quote: it must not reach the log.
_SECRET = "activation row 0.8125 -1.5"


class _Connection:
    def jetstream(self):
        return object()


class _Compute:
    active_streams = 0

    def __init__(self, *, eviction_fails: bool = False) -> None:
        self.evictions = 0
        self.eviction_fails = eviction_fails

    async def evict_idle(self) -> int:
        self.evictions += 1
        if self.eviction_fails:
            raise RuntimeError(_SECRET)
        return 0


class _OpenHop:
    def expiry_reason(self, now: float) -> str | None:
        return None


class _ExpiredHop:
    def expiry_reason(self, now: float) -> str | None:
        return "no step and no keepalive from its orchestrator for 9.0 s"


def _server(compute: _Compute, eviction_idle_s: float = 0.04) -> ShardServer:
    identity = ShardIdentity(shard_id="s", model_id="m", node_id="n", weights_sha256="w", layer_lo=0, layer_hi=3,
                             total_layers=8, dtype="float32", memory_required_mb=1.0, control_subject="hearth.ctl.n.s")
    # A round every 10 ms.
    settings = HearthSettings(transport={"orphan_timeout_s": 0.04}, shard={"eviction_idle_s": eviction_idle_s})
    return ShardServer(_Connection(), compute, identity, settings)


async def _until(condition, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


async def test_a_close_that_raises_does_not_end_the_watchdog(caplog):
    compute = _Compute()
    server = _server(compute)
    server._hops["failing"] = _ExpiredHop()
    server._hops["next"] = _ExpiredHop()
    closed: list[str] = []

    async def finish_closing(pipeline_id: str, hop, keep=None) -> None:
        closed.append(pipeline_id)
        if pipeline_id == "failing":
            raise RuntimeError(_SECRET)

    server._finish_closing = finish_closing
    watchdog = asyncio.create_task(server._watchdog_loop())
    try:
        with caplog.at_level(logging.DEBUG):
            await _until(lambda: "next" in closed)
            server._hops["later"] = _ExpiredHop()  # expires after the failure: a later round closes it
            await _until(lambda: "later" in closed)
            assert not watchdog.done()
    finally:
        watchdog.cancel()
        await asyncio.wait({watchdog}, timeout=2)

    assert closed == ["failing", "next", "later"]
    assert "RuntimeError" in caplog.text and "finish_closing" in caplog.text  # its type and where it was raised
    assert _SECRET not in caplog.text


async def test_an_eviction_that_raises_does_not_end_the_watchdog(caplog):
    compute = _Compute(eviction_fails=True)
    server = _server(compute)
    watchdog = asyncio.create_task(server._watchdog_loop())
    try:
        with caplog.at_level(logging.DEBUG):
            await _until(lambda: compute.evictions >= 3)
            assert not watchdog.done()
    finally:
        watchdog.cancel()
        await asyncio.wait({watchdog}, timeout=2)

    assert "RuntimeError" in caplog.text
    assert _SECRET not in caplog.text


async def test_with_no_hop_open_the_watchdog_waits_for_one_instead_of_going_round():
    compute = _Compute()
    server = _server(compute, eviction_idle_s=3600.0)  # a round every 10 ms while a hop is open
    watchdog = asyncio.create_task(server._watchdog_loop())
    try:
        await asyncio.sleep(0.2)  # twenty rounds' time
        assert compute.evictions == 0
        server._hops["open"] = _OpenHop()
        server._hop_opened.set()  # as opening a hop does
        await _until(lambda: compute.evictions >= 2)
        assert not watchdog.done()
    finally:
        watchdog.cancel()
        await asyncio.wait({watchdog}, timeout=2)
