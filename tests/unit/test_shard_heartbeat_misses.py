"""A shard whose heartbeats the broker does not store for a while (restarting, or its store's disk full) says so once
for the run of them and once when one is published again, not at every beat."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from hearth.services.shard.server import ShardServer


class _BeatingShard:
    """What ShardServer's heartbeat loop uses of the server: the interval, the claim, and `heartbeat`."""

    def __init__(self, failures: int) -> None:
        self.settings = SimpleNamespace(heartbeat_interval_s=0.001)
        self._claim = SimpleNamespace(kept=True)
        self.failures = failures
        self.beats = 0
        self.retry_log_levels: list[int] = []

    async def heartbeat(self, *, retry_log_level: int) -> None:
        self.beats += 1
        self.retry_log_levels.append(retry_log_level)
        if self.beats <= self.failures:
            raise TimeoutError("nats: timeout")
        if self.beats >= self.failures + 2:
            self._claim.kept = False  # ends the loop at its next beat


async def test_missed_heartbeats_are_said_once_and_their_end_once(caplog):
    shard = _BeatingShard(failures=5)
    with caplog.at_level(logging.INFO, logger="hearth.services.shard.server"):
        async with asyncio.timeout(10):
            await ShardServer._heartbeat_loop(shard)
    said = [(record.levelname, record.getMessage()) for record in caplog.records]
    assert [level for level, _ in said] == ["WARNING", "INFO"], said
    assert said[1][1] == "heartbeat published again after 5 missed"
    # Only the first beat of the run has its publish's retries said at WARNING.
    assert shard.retry_log_levels[:6] == [logging.WARNING] + [logging.DEBUG] * 5
