"""What the e2e tests that disturb the broker check afterwards: how far a read model has read (its
projection positions), and that no acknowledged event was lost: every gap in a stream's sequences is one its
limits explain, and a read model equals one rebuilt from the log."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from nats.aio.client import Client as NatsClient

from hearth.events.consume import StoredEvent, read_stream, stream_last_seq
from hearth.events.streams import ALL_STREAMS
from hearth.readmodels.rebuild import diff_databases, rebuild_database

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


def trimmed_below(retained: Iterable[tuple[int, str]], max_msgs_per_subject: int | None) -> int:
    """The sequence below which the stream's per-subject limit may have trimmed messages: the highest first retained
    sequence of a subject holding exactly that many (a subject's trimmed messages all precede its first retained
    one); 0 when no subject is at the limit or the stream has none."""
    if not max_msgs_per_subject or max_msgs_per_subject < 1:
        return 0
    counts: Counter[str] = Counter()
    first_seq_of: dict[str, int] = {}
    for seq, subject in retained:
        counts[subject] += 1
        first_seq_of[subject] = min(seq, first_seq_of.get(subject, seq))
    return max((first_seq_of[subject] for subject, count in counts.items() if count == max_msgs_per_subject),
               default=0)


def unexplained_gaps(retained: Sequence[tuple[int, str]], *, first_seq: int, last_seq: int, num_deleted: int,
                     max_msgs_per_subject: int | None, lost: Iterable[int] = ()) -> list[int]:
    """The sequences from `first_seq` to `last_seq` (the server's retained range) that `retained` (sequence, subject)
    lacks and the stream's limits do not explain, with those the server reports `lost`.

    max_age, max_bytes and max_msgs remove a stream's oldest messages, so they only move `first_seq`; an interior gap
    is trimming only when the server counts it as deleted and the per-subject limit explains it (below
    `trimmed_below`). If the server counts fewer deleted than are missing, it still holds a message the read did
    not return: every missing sequence is then unexplained, as none can be told apart."""
    held = {seq for seq, _ in retained}
    missing = [seq for seq in range(first_seq, last_seq + 1) if seq not in held]
    bound = trimmed_below(retained, max_msgs_per_subject) if len(missing) == num_deleted else 0
    return sorted({seq for seq in missing if seq >= bound} | set(lost))


async def stream_unexplained_gaps(nc: NatsClient, stream: str) -> list[int]:
    """`unexplained_gaps` of `stream` as it stands, its limits read from its config (the log must stand still)."""
    info = await nc.jetstream().stream_info(stream)
    state = info.state
    if not state.messages:
        return []
    async with contextlib.aclosing(read_stream(nc.jetstream(), stream, to_seq=state.last_seq)) as items:
        retained = [(item.seq, item.subject) async for item in items if isinstance(item, StoredEvent)]
    lost = state.lost.msgs if state.lost and state.lost.msgs else ()
    return unexplained_gaps(retained, first_seq=state.first_seq, last_seq=state.last_seq,
                            num_deleted=state.num_deleted or 0,
                            max_msgs_per_subject=info.config.max_msgs_per_subject, lost=lost)


async def assert_no_gap_unexplained(nc: NatsClient, stream: str) -> None:
    """Fail naming the sequences of `stream` that are missing and that its limits do not explain."""
    gaps = await stream_unexplained_gaps(nc, stream)
    assert not gaps, f"{stream}: sequences {gaps[:20]} lost ({len(gaps)} in all), not trimmed by its limits"


async def assert_no_event_lost(nc: NatsClient, read_model: Path, rebuilt: Path) -> None:
    """No stream has a gap its limits do not explain, and `read_model` (once it has read to the end) equals one
    rebuilt from the log. Stop what publishes first (shard hosts heartbeat), so the log stands still."""
    js = nc.jetstream()
    for stream in ALL_STREAMS:
        await assert_no_gap_unexplained(nc, stream)
    targets = {stream: await stream_last_seq(js, stream) for stream in ALL_STREAMS}
    await wait_for_positions(read_model, targets)
    await rebuild_database(js, rebuilt, overwrite=True)
    differences = diff_databases(rebuilt, read_model)
    assert differences == [], [str(d) for d in differences[:5]]
