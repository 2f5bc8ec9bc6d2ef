"""hearth-replay against a broker that fails it: one without JetStream, one that restarts under `events --follow` or
has no streams yet, one that lost a stream `verify` is to check, one that refuses the member reading."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy

from hearth.events.streams import PIPELINES_STREAM, ensure_streams
from hearth.services.broker.connection import connect_nats
from hearth.services.broker.permissions import render_authorization
from hearth.services.broker.server import EmbeddedNatsServer
from hearth.services.broker.streams import create_community_streams_blocking
from hearth.services.common.config import NatsSettings
from hearth.trust.community import Community, seed_path
from hearth.trust.roster import new_roster
from tests.integration.test_replay_cli import publish, replay, shard_history

pytestmark = pytest.mark.integration


class BrokerWithoutJetStream(EmbeddedNatsServer):
    """A nats-server that serves core NATS only: every JetStream request goes unanswered."""

    def render_config(self) -> str:
        return "\n".join(line for line in super().render_config().splitlines()
                         if line.startswith(("listen", "max_payload")))


@pytest.mark.parametrize("command", [["events"], ["pipeline", "p-7f3a9c"], ["shard", "8ce114b3009c"],
                                     ["rebuild", "--db", "{tmp}/new.sqlite"]])
def test_a_broker_without_jetstream_is_one_line_not_a_traceback(command, tmp_path):
    with BrokerWithoutJetStream(store_dir=tmp_path / "nats") as server:
        result = replay(server.url, *(part.format(tmp=tmp_path) for part in command))
    assert result.exit_code == 3 and result.stderr.strip().count("\n") == 0, result.output
    assert "JetStream" in result.stderr and "Traceback" not in result.output


def test_events_follow_carries_on_across_a_broker_restart(nats_server):
    before, after = shard_history()[:2]
    publish(nats_server.url, [(None, before)])
    with events_followed(nats_server.url) as lines:
        assert json.loads(lines.get(timeout=30))["event"]["event_id"] == before.event_id
        nats_server.restart()
        publish(nats_server.url, [(None, after)])

        assert json.loads(lines.get(timeout=30))["event"]["event_id"] == after.event_id


@contextlib.contextmanager
def events_followed(url: str) -> Iterator[queue.Queue[str]]:
    """`hearth-replay events --follow -o jsonl` on the broker at `url`: the lines it prints, as they come; stopped
    with SIGTERM on the way out, which it must end with exit code 130."""
    process = subprocess.Popen(
        [sys.executable, "-m", "hearth.services.replay.cli", "events", "--follow", "-o", "jsonl", "--nats", url],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    try:
        yield lines
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 130
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_verify_names_a_stream_that_does_not_exist_instead_of_passing_it_over(nats_url, tmp_path):
    roster = tmp_path / "roster.json"
    new_roster("test").save(roster)
    asyncio.run(_only_the_shards_stream(nats_url))

    result = replay(nats_url, "verify", "--roster", str(roster))

    assert result.exit_code == 0, result.output  # nothing stored is bad
    assert f"stream {PIPELINES_STREAM} does not exist" in result.stderr, result.output
    assert "HEARTH_SHARDS 0" in result.stdout


async def _only_the_shards_stream(url: str) -> None:
    nc = await connect_nats(url, name="test-one-stream")
    try:
        await ensure_streams(nc.jetstream())
        await nc.jetstream().delete_stream(PIPELINES_STREAM)
    finally:
        await nc.close()


def test_events_follow_on_a_broker_without_the_streams_yet_waits_for_them(nats_url):
    with events_followed(nats_url) as lines:
        time.sleep(2)  # it has looked for the streams and found none
        first = shard_history()[0]
        publish(nats_url, [(None, first)])  # creates both streams, as the first process on an open mesh does

        assert json.loads(lines.get(timeout=30))["event"]["event_id"] == first.event_id


def test_a_member_the_broker_refuses_is_told_so_in_one_line_not_a_timeout(tmp_path, monkeypatch):
    community = Community.init(tmp_path / "community", "test-community")
    community.add("alice", "client")  # a client may call orchestrators, not read the event log
    authorization = render_authorization(community.roster())
    with EmbeddedNatsServer(store_dir=tmp_path / "nats", authorization=authorization) as server:
        create_community_streams_blocking(NatsSettings(url=server.url, roster_file=community.roster_path),
                                          community.system_key_path, ready_timeout_s=10)
        # The key as --creds gives it, which a test run must not keep for the tests after it.
        monkeypatch.setenv("HEARTH_NATS__CREDS_FILE", str(seed_path(community.directory, "alice")))
        result = replay(server.url, "events")

    assert result.exit_code == 3, result.output
    assert "refused this member a request" in result.stderr and "cannot reach" not in result.stderr


def test_a_rebuild_that_fails_leaves_no_half_read_model_and_keeps_the_one_it_was_to_replace(nats_url, tmp_path):
    publish(nats_url, [(None, event) for event in shard_history()])
    fresh, kept = tmp_path / "fresh.sqlite", tmp_path / "kept.sqlite"
    assert replay(nats_url, "rebuild", "--db", str(kept)).exit_code == 0
    before = kept.read_bytes()

    def cap(dbapi_connection, _record) -> None:  # the disk fills up halfway
        dbapi_connection.execute("PRAGMA max_page_count = 4")

    sqlalchemy.event.listen(sqlalchemy.Engine, "connect", cap)
    try:
        failed = [replay(nats_url, "rebuild", "--db", str(fresh)),
                  replay(nats_url, "rebuild", "--db", str(kept), "--force")]
    finally:
        sqlalchemy.event.remove(sqlalchemy.Engine, "connect", cap)

    assert [result.exit_code for result in failed] == [1, 1], [result.output for result in failed]
    assert not fresh.exists() and kept.read_bytes() == before
    assert sorted(path.name for path in tmp_path.iterdir() if path.name != "nats") == ["kept.sqlite"]
    assert replay(nats_url, "rebuild", "--db", str(fresh)).exit_code == 0  # no --force needed: nothing was left


def test_a_rebuild_onto_a_directory_is_one_line_and_leaves_nothing_beside_it(nats_url, tmp_path):
    target = tmp_path / "models"
    target.mkdir()

    result = replay(nats_url, "rebuild", "--db", str(target), "--force")

    assert result.exit_code == 2 and "is a folder" in result.stderr, result.output
    assert sorted(path.name for path in tmp_path.iterdir() if path.name != "nats") == ["models"]


def test_a_reader_that_stops_reading_ends_it_quietly_not_as_a_broker_failure(nats_url):
    # `hearth-replay events | head -1`: the pipe's reader leaves after one line; that is no fault of the broker's.
    # More events than a pipe's buffer holds (64 KiB), so that printing them must meet the closed pipe.
    heartbeat = shard_history()[1]
    publish(nats_url, [(None, heartbeat.model_copy(update={"event_id": uuid.uuid4().hex, "tokens_served_total": n}))
                       for n in range(400)])
    reader, writer = os.pipe()
    process = subprocess.Popen([sys.executable, "-m", "hearth.services.replay.cli", "events", "--nats", nats_url],
                               stdout=writer, stderr=subprocess.PIPE, text=True)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        assert pipe.read(1)  # the first byte of the first event, then the reader goes away
    try:
        assert process.wait(timeout=30) == 0
        stderr = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert stderr == "", stderr
