"""The broker restarts mid-run: shard hosts re-advertise, both projectors (the orchestrator's routing read model
and a `hearth projector` process) resume, new requests succeed, and every event stored before the restart is
in the read model. Own mesh: restarting nats-server disturbs everything connected to it."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from pathlib import Path

import pytest

from events.consume import stream_last_seq
from events.models import ShardAdvertised
from events.streams import PIPELINES_STREAM, SHARDS_STREAM
from services.common.nats_connection import connect_nats
from tests.e2e.conftest import THREE_SHARD_RANGES
from tests.e2e.failover_support import (
    MAX_TOKENS,
    PRIMARY_WEIGHT,
    chat_request,
    failover_mesh,
    read_events,
    stream_with_action,
    wait_for_event,
)

pytestmark = pytest.mark.timeout(600)
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


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    with failover_mesh(tmp_path_factory, tiny_models_dir, "failover-nats-restart") as mesh:
        for index, (lo, hi) in enumerate(THREE_SHARD_RANGES):
            mesh.start_shard(f"p{index}", lo, hi, hop_weight=PRIMARY_WEIGHT, wait_ready=False)
        mesh.start_orchestrator(local_model=False)
        mesh.projector_db = mesh.cluster.work_dir / "projector.sqlite"
        mesh.cluster.start_projector(mesh.projector_db)
        mesh.cluster.wait_all_ready()
        yield mesh


async def test_nats_restart_mid_run(mesh):
    nc = await connect_nats(mesh.cluster.nats_url, name="failover-test")
    try:
        js = nc.jetstream()
        reference = await stream_with_action(nc, chat_request())
        assert reference.final.type == "done" and len(reference.token_ids) == MAX_TOKENS

        before: dict[str, int] = {}

        async def restart_broker() -> None:
            for stream in (SHARDS_STREAM, PIPELINES_STREAM):
                before[stream] = await stream_last_seq(js, stream)
            await asyncio.to_thread(mesh.cluster.nats.restart)

        # A request streaming while the broker goes away ends cleanly: completed, or aborted with a code.
        in_flight = await stream_with_action(nc, chat_request(), restart_broker)
        assert in_flight.final.type in ("done", "pipeline_aborted"), in_flight.final
        if in_flight.final.type == "done":
            assert in_flight.token_ids == reference.token_ids
        else:
            assert in_flight.final.code == "shard_unavailable"

        # Every shard host advertises again once reconnected.
        readvertised = {}
        for handle in mesh.shards.values():
            event = await wait_for_event(
                nc, SHARDS_STREAM, lambda item, shard_id=handle.shard_id: isinstance(item.event, ShardAdvertised)
                and item.event.shard_id == shard_id and item.seq > before[SHARDS_STREAM], timeout_s=resume_timeout_s)
            readvertised[handle.shard_id] = event.seq

        # The orchestrator's projector resumed (it routes on what came after the restart), and so did the
        # standalone one.
        await wait_for_positions(mesh.orchestrator_db, {SHARDS_STREAM: max(readvertised.values())})
        after = await stream_with_action(nc, chat_request())
        assert after.final.type == "done", after.final
        assert after.token_ids == reference.token_ids

        targets = {stream: await stream_last_seq(js, stream) for stream in (SHARDS_STREAM, PIPELINES_STREAM)}
        await wait_for_positions(mesh.projector_db, targets)

        # Nothing stored before the restart is missing: every pipeline in the log is a row whose status is the
        # one its events give it.
        for db in (mesh.projector_db, mesh.orchestrator_db):
            rows = {row["pipeline_id"]: row["status"] for row in query(db, "SELECT * FROM pipelines")}
            logged = [item for item in await read_events(nc, PIPELINES_STREAM) if item.seq <= before[PIPELINES_STREAM]]
            assert logged, "no pipeline event before the restart"
            for item in logged:
                assert item.event.pipeline_id in rows, (db.name, item.event.type, item.seq)
            assert rows[reference.pipeline_id] == "completed"
            shard_rows = {row["shard_id"]: row["status"] for row in query(db, "SELECT * FROM shards")}
            assert all(shard_rows.get(h.shard_id) == "advertised" for h in mesh.shards.values()), shard_rows
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)
