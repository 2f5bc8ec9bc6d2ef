"""What the e2e tests that disturb the broker check afterwards: how far a read model has read (its
projection positions), and that no acknowledged event was lost: both streams hold contiguous sequences and a
read model equals one rebuilt from the log."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from pathlib import Path

from nats.aio.client import Client as NatsClient

from events.consume import stream_last_seq
from events.streams import ALL_STREAMS
from readmodels.rebuild import diff_databases, rebuild_database
from tests.e2e.failover_support import read_events

# The projectors' ordered consumers notice a vanished consumer after ~3 missed 2 s idle heartbeats.
resume_timeout_s = 45.0


def query(db_path: Path, sql: str, *args) -> list[sqlite3.Row]:
    if not db_path.exists():
        return []
    with contextlib.closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)) as db:
        db.row_factory = sqlite3.Row
        try:
            return db.execute(sql, args).fetchall()
        except sqlite3.OperationalError:  # not migrated yet
            return []


def positions(db_path: Path) -> dict[str, int]:
    return {row["stream"]: row["last_seq"] for row in query(db_path, "SELECT * FROM projection_positions")}


async def wait_for_positions(db_path: Path, targets: dict[str, int], timeout_s: float = resume_timeout_s) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(positions(db_path).get(stream, 0) >= seq for stream, seq in targets.items()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{db_path.name} at {positions(db_path)}, expected at least {targets}")
        await asyncio.sleep(0.1)


async def assert_no_event_lost(nc: NatsClient, read_model: Path, rebuilt: Path) -> None:
    """Both streams hold contiguous sequences, and `read_model` (once it has read to the end) equals one rebuilt
    from the log. Stop what publishes first (shard hosts heartbeat), so the log stands still."""
    js = nc.jetstream()
    for stream in ALL_STREAMS:
        sequences = [item.seq for item in await read_events(nc, stream)]
        assert sequences == list(range(sequences[0], sequences[-1] + 1)), stream
    targets = {stream: await stream_last_seq(js, stream) for stream in ALL_STREAMS}
    await wait_for_positions(read_model, targets)
    await rebuild_database(js, rebuilt, overwrite=True)
    differences = diff_databases(rebuilt, read_model)
    assert differences == [], [str(d) for d in differences[:5]]
