"""The `hearth` command as processes: `hearth nats` starts and stops on signals, `db upgrade`, `projector` wiring."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig
from typer.testing import CliRunner

from hearth.events import SHARDS_STREAM, ensure_streams, publish_event, stream_last_seq
from hearth.events.models import ShardHeartbeat
from hearth.services.cli import app
from hearth.services.community_cli import community_app
from hearth.services.common.config import NatsSettings
from hearth.services.broker.connection import BrokerUnreachable, connect_nats
from hearth.services.broker.consumer_sweep import sweep_interval_s
from hearth.services.broker.listen_ports import free_tcp_port
from hearth.services.broker.tls import write_throwaway_ca
from hearth.trust.community import Community

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "HEARTH_NATS__INSECURE": "1"}  # an open broker
# `hearth nats --community` looks at its roster every half second; a reload then takes nats-server well under one.
ROSTER_APPLIED_WITHIN_S = 10.0


def heartbeat(n: int) -> ShardHeartbeat:
    return ShardHeartbeat(node_id="node-a", shard_id="tiny/m:0-1@node-a", queue_depth=0, active_streams=0,
                          p95_latency_ms=1.0, tokens_served_total=n)


async def _publish_and_count(url: str, n: int) -> int:
    nc = await connect_nats(url, name="test-hearth-cli")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        for i in range(n):
            await publish_event(js, heartbeat(i))
        return await stream_last_seq(js, SHARDS_STREAM)
    finally:
        await nc.close()


def port_is_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def start_hearth_nats(port: int, store: Path, *options: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [str(BIN / "hearth"), "nats", "--port", str(port), "--store", str(store), *options],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )
    url = process.stdout.readline().strip()
    if not url:
        process.kill()
        raise AssertionError(f"hearth nats printed no URL: {process.stderr.read()}")
    return process, url


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_hearth_nats_serves_jetstream_and_stops_cleanly_on_a_signal_keeping_its_store(tmp_path, signum):
    port = free_tcp_port()
    store = tmp_path / "store"
    process, url = start_hearth_nats(port, store)
    try:
        assert url == f"nats://127.0.0.1:{port}"
        assert asyncio.run(_publish_and_count(url, 3)) == 3

        process.send_signal(signum)
        assert process.wait(timeout=15) == 0
        assert not port_is_open(port)
        # Without --community it is open, and says so as the processes run with --insecure do.
        assert "an open broker (no --community): anyone who reaches" in process.stderr.read()

        # The same store on restart: the events are still there (file storage).
        process, url = start_hearth_nats(port, store)
        assert asyncio.run(_publish_and_count(url, 1)) == 4
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=15)
    assert not port_is_open(port)


def test_hearth_nats_reports_a_port_in_use(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [str(BIN / "hearth"), "nats", "--port", str(port), "--store", str(tmp_path / "s")],
            capture_output=True, text=True, timeout=60, env=ENV,
        )
    assert result.returncode == 1
    # Not taken for a nats-server that started: the listener on the port is someone else's.
    assert result.stdout == "", result.stdout
    assert f"hearth nats: cannot listen on 127.0.0.1:{port}: the port is in use" in result.stderr, result.stderr


def test_hearth_nats_keeps_its_store_in_the_state_folder_whatever_folder_it_starts_from(tmp_path, monkeypatch):
    """A household runs `hearth nats` from any folder: without --store, a restart from another folder finds the same
    store (its streams, the community's published weights) in hearth's state folder, one per client port."""
    port = free_tcp_port()
    stores = []
    for folder in ("here", "elsewhere"):
        (tmp_path / folder).mkdir()
        monkeypatch.chdir(tmp_path / folder)
        result = CliRunner().invoke(app, ["nats", "--check", "--port", str(port)],
                                    env={"XDG_STATE_HOME": str(tmp_path / "state")})
        assert result.exit_code == 0, result.output
        stores.append({path.parent for path in tmp_path.rglob("hearth-nats.conf")})
    assert stores[0] == stores[1] == {tmp_path / "state" / "hearth" / f"nats-{port}"}


def test_hearth_db_upgrade_creates_the_read_model_schema(tmp_path):
    db = tmp_path / "read.sqlite"
    result = CliRunner().invoke(app, ["db", "upgrade", "--db", str(db)])
    assert result.exit_code == 0, result.output
    with sqlite3.connect(db) as connection:
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"shards", "shard_health", "pipelines", "projection_positions", "alembic_version"} <= tables


def test_hearth_projector_follows_the_log_into_sqlite_and_stops_on_sigterm(nats_url, tmp_path):
    db = tmp_path / "projected.sqlite"
    asyncio.run(_publish_and_count(nats_url, 2))
    process = subprocess.Popen(
        [str(BIN / "hearth"), "projector", "--db", str(db)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**ENV, "HEARTH_NATS_URL": nats_url},
    )
    try:
        deadline = time.monotonic() + 30
        positions = {}
        while time.monotonic() < deadline and positions.get(SHARDS_STREAM) != 2:
            assert process.poll() is None, process.stderr.read()
            if db.exists():
                try:
                    with sqlite3.connect(db) as connection:
                        rows = connection.execute("SELECT stream, last_seq FROM projection_positions")
                        positions = dict(rows)
                except sqlite3.OperationalError:
                    pass  # the schema is still being created
            time.sleep(0.1)
        assert positions.get(SHARDS_STREAM) == 2
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0, process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_hearth_nats_for_a_community_over_tls_admits_members_only(tmp_path):
    community = Community.init(tmp_path / "community", "cli-test")
    alice = community.add("alice", "client").seed_file
    tls = write_throwaway_ca(tmp_path / "tls")
    process, url = start_hearth_nats(free_tcp_port(), tmp_path / "store", "--community", str(community.directory),
                                     "--tls-cert", str(tls.server_cert_file), "--tls-key", str(tls.server_key_file),
                                     "--tls-ca", str(tls.ca_file))
    tls_files = {"tls_ca_file": tls.ca_file, "tls_cert_file": tls.client_cert_file,
                 "tls_key_file": tls.client_key_file}

    async def connect_as(creds: Path | None) -> None:
        nc = await connect_nats(url, name="cli-test", settings=NatsSettings(
            url=url, creds_file=creds, connect_timeout_s=3, **tls_files))
        await nc.close()

    try:
        asyncio.run(connect_as(alice))
        with pytest.raises(BrokerUnreachable):  # refused at once, or never let in within the timeout
            asyncio.run(connect_as(None))
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0


def test_hearth_nats_applies_a_changed_roster_cutting_off_a_removed_member_and_letting_in_an_added_one(tmp_path):
    community = Community.init(tmp_path / "community", "cli-test")
    alice = community.add("alice", "client").seed_file
    alice_seed = alice.read_text()  # the removal deletes the file the steward still held
    process, url = start_hearth_nats(free_tcp_port(), tmp_path / "store", "--community", str(community.directory))
    cli = CliRunner()

    async def connect_as(seed: str, closed: asyncio.Event | None = None):
        async def on_closed() -> None:
            if closed is not None:
                closed.set()

        async def on_error(error: Exception) -> None:  # the server's "authorization violation" as it cuts off
            pass

        return await nats.connect(url, nkeys_seed_str=seed, allow_reconnect=False, connect_timeout=2,
                                  closed_cb=on_closed, error_cb=on_error)

    async def membership_changes() -> None:
        closed = asyncio.Event()
        connection = await connect_as(alice_seed, closed)
        # In a thread: the command runs an event loop of its own to publish the removal (and only the main thread
        # may set signal handlers, as `hearth` itself does).
        removed = await asyncio.to_thread(cli.invoke, community_app, ["remove", "--name", "alice", "--dir",
                                                                      str(community.directory), "--nats", url])
        assert removed.exit_code == 0, removed.output
        assert not alice.exists()
        await asyncio.wait_for(closed.wait(), ROSTER_APPLIED_WITHIN_S)  # nats-server closed her connection
        assert connection.is_closed
        with pytest.raises(Exception, match="(?i)authorization"):
            await connect_as(alice_seed)
        added = cli.invoke(app, ["community", "add", "--name", "bob", "--role", "client",
                                 "--offline", "--dir", str(community.directory)])
        assert added.exit_code == 0, added.output
        bob_seed = (community.directory / "keys" / "bob.nk").read_text()
        deadline = asyncio.get_running_loop().time() + ROSTER_APPLIED_WITHIN_S
        while True:  # let in once the broker has the new roster, without a restart
            try:
                await (await connect_as(bob_seed)).close()
                break
            except Exception:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.2)

    try:
        asyncio.run(membership_changes())
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    assert "roster changed" in process.stderr.read()


def test_hearth_nats_for_a_community_sweeps_a_consumer_that_pushes_a_stream_elsewhere(tmp_path):
    community = Community.init(tmp_path / "community", "cli-test")
    eve = community.add("eve", "auditor").seed_file
    process, url = start_hearth_nats(free_tcp_port(), tmp_path / "store", "--community", str(community.directory))

    async def push_elsewhere_and_wait() -> None:
        reader = await connect_nats(url, settings=NatsSettings(url=url, creds_file=eve, connect_timeout_s=5))
        steward = await connect_nats(url, settings=NatsSettings(url=url, creds_file=community.system_key_path,
                                                                connect_timeout_s=5))
        try:
            await reader.jetstream().add_consumer(SHARDS_STREAM, ConsumerConfig(
                name="pushes-elsewhere", ack_policy=AckPolicy.NONE, deliver_subject="llm.chat.request"))
            deadline = time.monotonic() + sweep_interval_s + ROSTER_APPLIED_WITHIN_S
            while any(info.name == "pushes-elsewhere"
                      for info in await steward.jetstream().consumers_info(SHARDS_STREAM)):
                assert time.monotonic() < deadline, "the consumer was never swept"
                await asyncio.sleep(0.2)
        finally:
            await reader.close()
            await steward.close()

    try:
        asyncio.run(push_elsewhere_and_wait())
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    assert ("deleted consumer pushes-elsewhere of HEARTH_SHARDS: eve made it deliver to 'llm.chat.request', "
            "not into eve's own inbox") in process.stderr.read()


def test_hearth_nats_for_a_community_bounds_the_weights_store_beside_the_event_streams(tmp_path):
    """Before, the weights bucket had no bound and could take the room the event streams reserve."""
    from hearth.services.broker.weights_bucket import bucket_room, shown_size

    community = Community.init(tmp_path / "community", "cli-test")
    process, url = start_hearth_nats(free_tcp_port(), tmp_path / "store", "--community", str(community.directory))

    async def weights_room():
        steward = await connect_nats(url, settings=NatsSettings(url=url, creds_file=community.system_key_path,
                                                                connect_timeout_s=5))
        try:
            return await bucket_room(steward.jetstream())
        finally:
            await steward.close()

    try:
        room = asyncio.run(weights_room())
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    assert room.bound > 0 and room.held == 0
    assert f"event streams ready; the weights store may hold {shown_size(room.bound)}" in process.stderr.read()
