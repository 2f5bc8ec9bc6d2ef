"""Signed events end to end, over real processes (nats-server with the community's permissions, 3 shard hosts,
an orchestrator, a projector): a normal call's events are all signed and verify; forged, foreign-signed,
wrong-node, future-dated and tampered advertisements and withdrawals, injected with the broker's system user
(standing for a compromised or misconfigured broker), change no route, land in rejected_events of both read
models with their reason, and make `hearth-replay verify` exit 1 naming each of them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from hearth.events.consume import StoredEvent, read_stream
from hearth.events.models import ShardAdvertised, ShardWithdrawn
from hearth.events.publish import publish_event
from hearth.events.signing import EventVerifier, sign_event
from hearth.events.streams import ALL_STREAMS
from hearth.protocol.subjects import shard_control_subject, shard_id_for
from hearth.services.devtools.local_cluster import LocalCluster
from hearth.services.client.chat import chat
from hearth.protocol.mesh_protocol import MESH_PROTOCOL
from hearth.protocol.chat import ChatRequest
from hearth.services.broker.connection import connect_nats
from tests.e2e.conftest import TINY_MODEL_NAME, TINY_LAYERS, three_shard_mesh
from hearth.trust.keys import MemberKey

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "the quick brown fox"
NEW_TOKENS = 12
READ_MODEL_WAIT_S = 60.0
POLL_INTERVAL_S = 0.2
REPLAY_TIMEOUT_S = 120.0
ONE_HOUR = timedelta(hours=1)


@pytest.fixture(scope="module")
def signed_mesh(tmp_path_factory, tiny_models_dir):
    """One community mesh for the module; the orchestrator's routing read model and a projector's are files
    the tests read."""
    work_dir = tmp_path_factory.mktemp("signed-mesh")
    with three_shard_mesh(work_dir, tiny_models_dir, orchestrator_args=["--db", str(work_dir / "routing.sqlite")],
                          projector_db=work_dir / "projector.sqlite") as mesh:
        yield mesh


def read_models(mesh: LocalCluster) -> dict[str, Path]:
    return {"orchestrator": mesh.work_dir / "routing.sqlite", "projector": mesh.work_dir / "projector.sqlite"}


def query(db: Path, sql: str, *args) -> list[tuple]:
    if not db.exists():
        return []
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as connection:
        try:
            return connection.execute(sql, args).fetchall()
        except sqlite3.OperationalError:  # not migrated yet
            return []


async def wait_for_rows(db: Path, sql: str, expected_count: int, *args) -> list[tuple]:
    deadline = time.monotonic() + READ_MODEL_WAIT_S
    while True:
        rows = query(db, sql, *args)
        if len(rows) >= expected_count or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(POLL_INTERVAL_S)


def replay_verify(mesh: LocalCluster) -> subprocess.CompletedProcess:
    """`hearth-replay verify` as an auditor of the community, the way an operator runs it."""
    env = {**os.environ, **mesh.credentials_env(mesh.member_key("auditor", "auditor")), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "hearth.services.replay.cli", "verify", "--nats", mesh.nats_url],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=REPLAY_TIMEOUT_S)


async def stored_events(mesh: LocalCluster) -> list[StoredEvent]:
    nc = await connect_nats(mesh.nats_url, name="signed-events-reader", settings=mesh.nats_settings())
    try:
        events = []
        for stream in ALL_STREAMS:
            async with contextlib.aclosing(read_stream(nc.jetstream(), stream)) as messages:
                events += [message async for message in messages]
        return events
    finally:
        await nc.close()


async def ask(mesh: LocalCluster):
    nc = await connect_nats(mesh.nats_url, name="signed-events-client", settings=mesh.nats_settings())
    try:
        result = await chat(nc, ChatRequest(model=TINY_MODEL_NAME, prompt=PROMPT, max_tokens=NEW_TOKENS))
    finally:
        await nc.close()
    assert result.ok, result.final
    return result.token_ids, result.frames_of("pipeline")[0].hops


@pytest.fixture(scope="module")
def untouched_answer(signed_mesh):
    """The answer and route of the mesh before any test forges an event (asked once, whichever test runs first)."""
    return asyncio.run(ask(signed_mesh))


async def test_a_normal_call_is_all_signed_events_that_verify(signed_mesh, untouched_answer):
    for name, db in read_models(signed_mesh).items():
        rows = await wait_for_rows(db, "SELECT pipeline_id FROM pipelines WHERE status = 'completed'", 1)
        assert rows, f"{name} read model never saw the call complete"
        assert query(db, "SELECT * FROM rejected_events") == [], name

    verifier = EventVerifier(signed_mesh.community.roster(), max_clock_skew_s=30)
    events = await stored_events(signed_mesh)
    families = {message.event.type.split(".")[0] for message in events}
    assert {"shard", "pipeline"} <= families
    roster = signed_mesh.community.roster()
    for message in events:
        assert isinstance(message, StoredEvent), message
        event = message.event
        assert event.signer is not None and roster.by_key(event.signer).name == event.node_id, event
        assert verifier.rejection(event, received_at=message.time, stored_data=message.data) is None, event

    audit = replay_verify(signed_mesh)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    # Heartbeats keep coming, so the audit may read a few more events than the loop above did.
    assert "every one signed by a member that may emit it" in audit.stdout, audit.stdout


def forged_events(mesh: LocalCluster, real_shards: dict[str, tuple[str, str]]) -> list[tuple[object, str]]:
    """(event, the reason it must be rejected for): each an attempt to take over or break routing."""
    def key(name: str, role: str) -> MemberKey:
        return MemberKey.load(mesh.member_key(name, role))

    host0, host1 = key("host0", "shard"), key("host1", "shard")
    mallory = key("mallory", "client")  # a member, but a client: it may emit nothing
    outsider = MemberKey.generate()  # not in the roster at all
    now = datetime.now(timezone.utc)
    host1_shard, weights = real_shards["host1"]

    def whole_model(node: str, *, occurred_at: datetime = now) -> ShardAdvertised:
        """One hop serving every layer with the real checksum: the router would prefer it to three."""
        shard_id = shard_id_for(TINY_MODEL_NAME, 0, TINY_LAYERS - 1, node)
        return ShardAdvertised(
            node_id=node, shard_id=shard_id, model_id=TINY_MODEL_NAME, weights_sha256=weights, layer_lo=0,
            layer_hi=TINY_LAYERS - 1, total_layers=TINY_LAYERS, dtype="float32", memory_required_mb=1.0,
            max_concurrent_streams=64, control_subject=shard_control_subject(node, shard_id), hop_weight=0.01,
            ttl_s=86_400.0, occurred_at=occurred_at, protocol=MESH_PROTOCOL)

    def withdrawal(node: str, *, occurred_at: datetime = now) -> ShardWithdrawn:
        return ShardWithdrawn(node_id=node, shard_id=host1_shard, reason="forged", occurred_at=occurred_at)

    tampered = sign_event(withdrawal("host1"), host1).model_copy(update={"reason": "tampered after signing"})
    return [
        (whole_model("forger", occurred_at=now + ONE_HOUR), "unsigned"),
        (withdrawal("host1"), "unsigned"),
        (sign_event(whole_model("mallory"), mallory), "role_may_not_emit"),
        (sign_event(withdrawal("host1"), mallory), "role_may_not_emit"),
        (sign_event(whole_model("host1"), host0), "node_mismatch"),
        (sign_event(withdrawal("host1"), host0), "node_mismatch"),
        (sign_event(withdrawal("host0"), host0), "node_mismatch"),  # its own node, another host's shard
        (sign_event(whole_model("host1", occurred_at=now + ONE_HOUR), host1), "future_dated"),
        (sign_event(withdrawal("host1", occurred_at=now + ONE_HOUR), host1), "future_dated"),
        (sign_event(whole_model("host1"), outsider), "unknown_signer"),
        (tampered, "bad_signature"),
    ]


async def test_forged_events_change_no_route_and_are_kept_as_rejected(signed_mesh, untouched_answer):
    orchestrator_db = read_models(signed_mesh)["orchestrator"]
    real_shards = {node: (shard_id, weights) for shard_id, node, weights in
                   query(orchestrator_db, "SELECT shard_id, node_id, weights_sha256 FROM shards")}
    assert sorted(real_shards) == ["host0", "host1", "host2"]
    forged = forged_events(signed_mesh, real_shards)

    nc = await connect_nats(signed_mesh.nats_url, name="forger", settings=signed_mesh.nats_settings())
    try:
        for event, _reason in forged:  # as they are: the system user publishes whatever it is given
            await publish_event(nc.jetstream(), event)
    finally:
        await nc.close()

    expected = {event.event_id: reason for event, reason in forged}
    for name, db in read_models(signed_mesh).items():
        rows = await wait_for_rows(db, "SELECT event_id, reason FROM rejected_events", len(forged))
        assert dict(rows) == expected, name
        shards = query(db, "SELECT node_id, layer_lo, layer_hi, status FROM shards ORDER BY node_id")
        assert shards == [("host0", 0, 1, "advertised"), ("host1", 2, 3, "advertised"),
                          ("host2", 4, 5, "advertised")], name

    token_ids, hops = await ask(signed_mesh)
    assert (token_ids, hops) == untouched_answer

    audit = replay_verify(signed_mesh)
    assert audit.returncode == 1, audit.stdout + audit.stderr
    bad_lines = [line for line in audit.stdout.splitlines() if line.startswith("HEARTH_")]
    assert len(bad_lines) == len(forged), audit.stdout
    for event, reason in forged:
        assert any(event.event_id in line and line.endswith(f": {reason}") for line in bad_lines), (event, reason)
    assert f"{len(forged)} bad" in audit.stdout
