"""The projector against a real nats-server: kill -9 and restart, delete and replay, rebuild and diff."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import text

from hearth.events.publish import publish_event
from hearth.events.streams import PIPELINES_STREAM, SHARDS_STREAM
from hearth.readmodels.db import open_engine
from hearth.readmodels.rebuild import diff_databases, rebuild_database
from hearth.readmodels.runner import Projector
from tests.readmodel_helpers import dump_rows, heartbeat, synthetic_events
from tests.event_streams import jetstream_with_streams

pytestmark = pytest.mark.integration

wait_timeout_s = 20.0
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def js(nats_url):
    async with jetstream_with_streams(nats_url, "test-projector") as jetstream:
        yield jetstream


async def publish_all(js, events) -> dict[str, int]:
    """Publish in order; returns the last sequence per stream."""
    last: dict[str, int] = {}
    for event in events:
        ack = await publish_event(js, event)
        last[ack.stream] = ack.seq
    return last


def db_dump(path: Path) -> dict[str, list[tuple]]:
    engine = open_engine(path)
    try:
        return dump_rows(engine)
    finally:
        engine.dispose()


def stored_positions(path: Path) -> dict[str, int]:
    if not path.exists():
        return {}
    engine = open_engine(path)
    try:
        with engine.connect() as connection:
            try:
                rows = connection.execute(text("SELECT stream, last_seq FROM projection_positions")).all()
            except Exception:  # not migrated yet
                return {}
        return dict(rows)
    finally:
        engine.dispose()


async def wait_for_positions(path: Path, expected: dict[str, int], process: subprocess.Popen) -> None:
    deadline = time.monotonic() + wait_timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"projector exited with {process.returncode}"
        positions = stored_positions(path)
        if all(positions.get(stream, 0) >= seq for stream, seq in expected.items()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"projector at {stored_positions(path)}, expected {expected}")


def start_projector_process(db_path: Path, nats_url: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "hearth.services.projector", "--db", str(db_path), "--nats-url", nats_url],
        cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def sigkill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)


async def uninterrupted_dump(js, tmp_path: Path, name: str) -> dict[str, list[tuple]]:
    path = tmp_path / name
    async with Projector(path, js) as projector:
        await projector.wait_until_caught_up(wait_timeout_s)
    return db_dump(path)


async def test_projector_killed_and_restarted_ends_with_the_rows_of_an_uninterrupted_run(js, nats_url, tmp_path):
    db_path = tmp_path / "killed.db"
    first = synthetic_events(pipelines=30, heartbeats_per_shard=15, seed=1)
    second = synthetic_events(pipelines=30, heartbeats_per_shard=15, seed=2, t0=100.0)
    third = synthetic_events(pipelines=200, heartbeats_per_shard=100, seed=3, t0=200.0)

    process = start_projector_process(db_path, nats_url)
    try:
        # Killed between two events: everything of `first` applied, nothing of `second` published yet.
        await wait_for_positions(db_path, await publish_all(js, first), process)
        sigkill(process)
        after_second = await publish_all(js, second)
        process = start_projector_process(db_path, nats_url)
        await wait_for_positions(db_path, after_second, process)
        # Killed wherever it is while catching up on a larger backlog (between or inside a transaction).
        sigkill(process)
        after_third = await publish_all(js, third)
        process = start_projector_process(db_path, nats_url)
        await wait_for_positions(db_path, {SHARDS_STREAM: after_second[SHARDS_STREAM] + 1}, process)
        sigkill(process)
        process = start_projector_process(db_path, nats_url)
        await wait_for_positions(db_path, after_third, process)
        # One more event proves this process is up and following (not just started on a finished file).
        final = await publish_all(js, [heartbeat(third[0].shard_id, t=999.0, tokens=12345)])
        await wait_for_positions(db_path, final, process)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=10)
    assert process.returncode == 0, process.stderr.read().decode()[-2000:]

    restarted = db_dump(db_path)
    assert restarted == await uninterrupted_dump(js, tmp_path, "uninterrupted.db")
    # Not vacuous: every pipeline of the three batches has its row.
    assert len(restarted["pipelines"]) == 260
    assert dict((stream, seq) for _proj, stream, seq, _at in restarted["projection_positions"]) == {
        **after_third, **final}


async def test_deleting_the_database_and_replaying_gives_identical_rows(js, tmp_path):
    db_path = tmp_path / "replayed.db"
    await publish_all(js, synthetic_events(pipelines=40, heartbeats_per_shard=20, seed=4))
    async with Projector(db_path, js) as projector:
        await projector.wait_until_caught_up(wait_timeout_s)
    before = db_dump(db_path)
    assert len(before["pipelines"]) == 40 and len(before["shards"]) == 4

    for suffix in ("", "-wal", "-shm"):
        Path(f"{db_path}{suffix}").unlink(missing_ok=True)
    async with Projector(db_path, js) as projector:
        await projector.wait_until_caught_up(wait_timeout_s)
    assert db_dump(db_path) == before


async def test_rebuild_and_diff_report_rows_altered_by_hand(js, tmp_path):
    live_path, new_path = tmp_path / "live.db", tmp_path / "rebuilt.db"
    last = await publish_all(js, synthetic_events(pipelines=25, heartbeats_per_shard=10, seed=5))
    async with Projector(live_path, js) as projector:
        await projector.wait_until_caught_up(wait_timeout_s)

    applied = await rebuild_database(js, new_path)
    assert applied == last[SHARDS_STREAM] + last[PIPELINES_STREAM]
    assert diff_databases(new_path, live_path) == []
    assert diff_databases(new_path, live_path, include_positions=True) == []

    engine = open_engine(live_path)
    with engine.begin() as connection:
        connection.execute(text("UPDATE pipelines SET status = 'aborted', ttft_ms = 1.5 WHERE pipeline_id = 'p5-3'"))
        connection.execute(text("DELETE FROM shard_health WHERE shard_id = (SELECT min(shard_id) FROM shard_health)"))
        connection.execute(text("INSERT INTO failovers VALUES ('ghost', 1, 'x', '[]', 'made up', 0, 0)"))
    engine.dispose()

    differences = diff_databases(new_path, live_path)
    summary = sorted((d.table, d.kind, d.columns) for d in differences)
    assert summary == [
        ("failovers", "extra_in_live", ()),
        ("pipelines", "changed", ("status", "ttft_ms")),
        ("shard_health", "missing_in_live", ()),
    ]
    changed = next(d for d in differences if d.kind == "changed")
    assert changed.key == {"pipeline_id": "p5-3"}
    assert "pipelines[pipeline_id='p5-3']" in str(changed) and "live 'aborted'" in str(changed)
    assert "extra in live" in str(next(d for d in differences if d.table == "failovers"))

    with pytest.raises(FileExistsError):
        await rebuild_database(js, new_path)
