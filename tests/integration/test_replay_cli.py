"""hearth-replay against a real nats-server: events, pipeline and shard views, rebuild/diff, no consumers left."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import Engine, event
from typer.testing import CliRunner

from hearth.events import (
    PIPELINES_STREAM,
    SHARDS_STREAM,
    decode_event,
    ensure_streams,
    event_subject,
    publish_event,
    stream_for_subject,
)
from hearth.events.models import ShardAdvertised, ShardHeartbeat, ShardWithdrawn
from hearth.services.broker.connection import connect_nats
from hearth.readmodels.db import upgrade_database
from hearth.services.replay.cli import app

pytestmark = pytest.mark.integration

EXAMPLES_PATH = Path(__file__).resolve().parents[2] / "docs" / "examples" / "events.jsonl"
BIN = Path(sys.executable).parent
runner = CliRunner()


def example_records() -> list[dict]:
    return [json.loads(line) for line in EXAMPLES_PATH.read_text().splitlines() if line.strip()]


async def _publish(url: str, items: list[tuple[str | None, object]], raw: list[tuple[str, bytes]] = ()) -> None:
    nc = await connect_nats(url, name="test-seed")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        for subject, event in items:
            await publish_event(js, event, subject=subject)
        for subject, payload in raw:
            await js.publish(subject, payload)
    finally:
        await nc.close()


def publish(url: str, items, raw=()) -> None:
    asyncio.run(_publish(url, list(items), list(raw)))


def seed_examples(url: str, raw=(), *, dated_now: bool = False) -> list[dict]:
    """Publish the contract's example events; `dated_now`: moved in time so that the newest occurred now (as they
    were written they are older than a read model keeps, and a rebuild rejects them `too_old`)."""
    records = example_records()
    events = [decode_event(r["event"]) for r in records]
    if dated_now:
        shift = datetime.now(timezone.utc) - max(event.occurred_at for event in events)
        events = [event.model_copy(update={"occurred_at": event.occurred_at + shift}) for event in events]
    publish(url, [(r["subject"], event) for r, event in zip(records, events)], raw)
    return records


async def _consumer_counts(url: str) -> dict[str, int]:
    nc = await connect_nats(url, name="test-consumers")
    try:
        js = nc.jetstream()
        return {s: (await js.stream_info(s)).state.consumer_count for s in (SHARDS_STREAM, PIPELINES_STREAM)}
    finally:
        await nc.close()


def consumer_counts(url: str) -> dict[str, int]:
    return asyncio.run(_consumer_counts(url))


def replay(url: str, *args: str):
    result = runner.invoke(app, [*args, "--nats", url])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def test_events_prints_both_streams_merged_by_time_and_leaves_no_consumer(nats_url):
    records = seed_examples(nats_url, raw=[("hearth.events.pipeline.p-x.first_token", b"garbage")])

    result = replay(nats_url, "events")

    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == len(records) + 1
    # Published one after the other, so store-time order is the example order, across both streams.
    for line, record in zip(lines, records):
        assert record["event"]["type"] in line
        assert (SHARDS_STREAM if ".shard." in record["subject"] else PIPELINES_STREAM) in line
    assert "UNDECODABLE" in lines[-1] and "hearth.events.pipeline.p-x.first_token" in lines[-1]
    assert consumer_counts(nats_url) == {SHARDS_STREAM: 0, PIPELINES_STREAM: 0}


def test_events_jsonl_carries_stream_seq_subject_time_headers_and_the_event(nats_url):
    records = seed_examples(nats_url, raw=[("hearth.events.shard.ab.heartbeat", b"{}")])

    result = replay(nats_url, "events", "--output", "jsonl")

    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    decoded = [row for row in rows if "event" in row]
    assert [row["event"]["event_id"] for row in decoded] == [r["event"]["event_id"] for r in records]
    for row, record in zip(decoded, records):
        assert row["subject"] == record["subject"]
        assert row["headers"]["Nats-Msg-Id"] == record["event"]["event_id"]
        assert decode_event(row["event"]) == decode_event(record["event"])
        assert datetime.fromisoformat(row["time"]).tzinfo is not None
        assert isinstance(row["seq"], int) and row["stream"] in (SHARDS_STREAM, PIPELINES_STREAM)
    (skipped,) = [row for row in rows if row.get("skipped")]
    assert skipped["stream"] == SHARDS_STREAM and skipped["subject"] == "hearth.events.shard.ab.heartbeat"
    assert "validation error" in skipped["error"]


def test_events_filters_by_type_subject_stream_sequence_time_and_limit(nats_url):
    seed_examples(nats_url)

    def types(*args: str) -> list[str]:
        result = replay(nats_url, "events", "-o", "jsonl", *args)
        assert result.exit_code == 0, result.output
        return [json.loads(line)["event"]["type"] for line in result.stdout.splitlines()]

    assert types("--type", "shard.withdrawn", "--type", "pipeline.aborted") == [
        "pipeline.aborted", "shard.withdrawn",
    ]
    assert types("--type", "shard") == ["shard.advertised", "shard.heartbeat", "shard.withdrawn"]
    assert types("--subject", "hearth.events.pipeline.p-7f3a9c.>") == [
        "pipeline.constructed", "pipeline.first_token", "pipeline.shard_status", "pipeline.failover",
        "pipeline.completed",
    ]
    assert types("--stream", SHARDS_STREAM, "--from-seq", "2", "--to-seq", "2") == ["shard.heartbeat"]
    assert types("--stream", PIPELINES_STREAM, "--limit", "2") == ["pipeline.constructed", "pipeline.first_token"]
    assert len(types("--since", "10m")) == len(example_records())
    future = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()
    assert types("--from-time", future) == []
    assert consumer_counts(nats_url) == {SHARDS_STREAM: 0, PIPELINES_STREAM: 0}


def test_events_rejects_bad_options_with_a_message(nats_url):
    result = replay(nats_url, "events", "--since", "5 fortnights")
    assert result.exit_code == 2 and "duration" in result.output
    result = replay(nats_url, "events", "--type", "shard.exploded")
    assert result.exit_code == 2 and "unknown event type" in result.output
    result = replay(nats_url, "events", "--since", "5m", "--from-time", "2026-01-01T00:00:00Z")
    assert result.exit_code == 2


def test_events_on_a_fresh_server_says_the_streams_do_not_exist(nats_url):
    result = replay(nats_url, "events")
    assert result.exit_code == 0
    assert result.stdout == ""
    assert "does not exist yet" in result.output


def test_an_unreachable_server_is_reported_quickly():
    started = time.monotonic()
    result = runner.invoke(app, ["events", "--nats", "nats://127.0.0.1:1"])
    assert result.exit_code == 3 and "cannot reach NATS" in result.output
    assert time.monotonic() - started < 20


def test_pipeline_prints_its_timeline_relative_to_the_first_event(nats_url):
    seed_examples(nats_url)

    result = replay(nats_url, "pipeline", "p-7f3a9c")

    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("pipeline p-7f3a9c: 5 events")
    assert [line.split()[:2] for line in lines[1:6]] == [
        ["+0.000s", "pipeline.constructed"],
        ["+1.000s", "pipeline.first_token"],
        ["+2.000s", "pipeline.shard_status"],
        ["+3.000s", "pipeline.failover"],
        ["+4.000s", "pipeline.completed"],
    ]
    assert "resumed_at_token=17" in lines[4]
    assert lines[-1] == "outcome: completed, verification met"
    as_jsonl = [json.loads(line)
                for line in replay(nats_url, "pipeline", "p-7f3a9c", "-o", "jsonl").stdout.splitlines()]
    assert (as_jsonl[-1]["outcome"], as_jsonl[-1]["verification"]) == ("completed", "met")
    assert all("outcome" not in row for row in as_jsonl[:-1])

    integrity = replay(nats_url, "pipeline", "p-00cc33")
    assert integrity.exit_code == 0
    assert "integrity.corruption_detected" in integrity.stdout and "check=nan" in integrity.stdout
    aborted = replay(nats_url, "pipeline", "p-00aa11", "-o", "jsonl")
    (row,) = [json.loads(line) for line in aborted.stdout.splitlines()]
    assert row["event"]["code"] == "shard_unavailable" and row["offset_s"] == 0
    assert row["outcome"] == "aborted" and "verification" not in row

    unknown = replay(nats_url, "pipeline", "p-nope")
    assert unknown.exit_code == 1 and "no events for pipeline p-nope" in unknown.output
    assert replay(nats_url, "pipeline", "bad.id").exit_code == 2
    assert consumer_counts(nats_url) == {SHARDS_STREAM: 0, PIPELINES_STREAM: 0}


SHARD_ID = "tiny/m:0-3@node-a"
T0 = datetime(2026, 11, 21, 12, 0, 0, tzinfo=timezone.utc)


def shard_history() -> list:
    def at(seconds: float) -> datetime:
        return T0 + timedelta(seconds=seconds)

    def beat(t: float) -> ShardHeartbeat:
        return ShardHeartbeat(node_id="node-a", occurred_at=at(t), shard_id=SHARD_ID, queue_depth=1,
                              active_streams=0, p95_latency_ms=3.0, tokens_served_total=int(t))

    advertised = ShardAdvertised(
        node_id="node-a", occurred_at=at(0), shard_id=SHARD_ID, model_id="tiny/m", weights_sha256="ab" * 32,
        layer_lo=0, layer_hi=3, total_layers=8, dtype="float32", memory_required_mb=1, max_concurrent_streams=2,
        control_subject="hearth.ctl.node-a.x", ttl_s=60,
    )
    withdrawn = ShardWithdrawn(node_id="node-a", occurred_at=at(100), shard_id=SHARD_ID, reason="shutdown")
    return [advertised, beat(5), beat(10), beat(55), beat(60), beat(95), withdrawn]


def test_shard_reports_advertisement_gaps_over_the_health_timeout_and_withdrawal(nats_url, tmp_path):
    other = ShardHeartbeat(node_id="node-b", shard_id="tiny/m:4-7@node-b", queue_depth=0, active_streams=0,
                           p95_latency_ms=1.0, tokens_served_total=0)
    publish(nats_url, [(None, e) for e in shard_history()] + [(None, other)])

    result = replay(nats_url, "shard", SHARD_ID)

    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"shard {SHARD_ID}") and "6 events" not in lines[0] and "7 events" in lines[0]
    kinds = [line.split()[1] for line in lines[1:]]
    assert kinds == ["advertised", "heartbeat", "gap", "heartbeat", "gap", "heartbeat", "withdrawn"]
    assert "45.0s without heartbeat (> 30s)" in lines[3]
    assert "35.0s without heartbeat (> 30s)" in lines[5]

    # --health-timeout-s overrides; the configuration file sets the default.
    strict = replay(nats_url, "shard", SHARD_ID, "--health-timeout-s", "40")
    assert strict.stdout.count("without heartbeat") == 1
    config = tmp_path / "hearth.toml"
    config.write_text("[research.distributed_inference]\nshard_health_timeout_s = 50\n")
    from_config = runner.invoke(app, ["--config", str(config), "shard", SHARD_ID, "--nats", nats_url])
    assert from_config.exit_code == 0 and from_config.stdout.count("without heartbeat") == 0

    by_key = replay(nats_url, "shard", event_subject(other).split(".")[4])  # hearth.events.shard.<node>.<key>.<kind>
    assert by_key.exit_code == 0 and "tiny/m:4-7@node-b" in by_key.stdout
    assert replay(nats_url, "shard", "tiny/none:0-1@x").exit_code == 1
    assert consumer_counts(nats_url) == {SHARDS_STREAM: 0, PIPELINES_STREAM: 0}


def test_rebuild_writes_a_fresh_read_model_and_diff_reports_every_differing_row(nats_url, tmp_path):
    seed_examples(nats_url, dated_now=True)
    live = tmp_path / "live.sqlite"

    first = replay(nats_url, "rebuild", "--db", str(live))
    assert first.exit_code == 0, first.output
    assert f"rebuilt {live} from {len(example_records())} messages" in first.stdout

    same = replay(nats_url, "rebuild", "--db", str(tmp_path / "same.sqlite"), "--diff", str(live))
    assert same.exit_code == 0, same.output
    assert "no differences" in same.stdout

    exists = replay(nats_url, "rebuild", "--db", str(live))
    assert exists.exit_code == 2 and "--force" in exists.output

    # An advert of now: one dated at T0 expired long ago, and a rebuild prunes it as history (retention).
    fresh = shard_history()[0].model_copy(update={"occurred_at": datetime.now(timezone.utc)})
    publish(nats_url, [(None, fresh)])
    newer = tmp_path / "newer.sqlite"
    differs = replay(nats_url, "rebuild", "--db", str(newer), "--diff", str(live))
    assert differs.exit_code == 1, differs.output
    assert f"{SHARD_ID}" in differs.stdout and "missing in live" in differs.stdout
    assert "rows differ" in differs.output

    forced = replay(nats_url, "rebuild", "--db", str(newer), "--force")
    assert forced.exit_code == 0, forced.output
    assert consumer_counts(nats_url) == {SHARDS_STREAM: 0, PIPELINES_STREAM: 0}


def _read_line(process: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if line:
            return line
        if process.poll() is not None:
            raise AssertionError(f"process exited with {process.returncode}: {process.stderr.read()}")
        time.sleep(0.02)
    raise AssertionError("no output in time")


def test_events_follow_prints_new_events_of_both_streams_and_stops_cleanly_on_sigterm(nats_url):
    records = seed_examples(nats_url)
    process = subprocess.Popen(
        [str(BIN / "hearth-replay"), "events", "--follow", "-o", "jsonl", "--nats", nats_url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        backlog = [json.loads(_read_line(process, 30)) for _ in records]
        assert {row["event"]["event_id"] for row in backlog} == {r["event"]["event_id"] for r in records}
        for stream in (SHARDS_STREAM, PIPELINES_STREAM):  # each stream in its own order
            seqs = [row["seq"] for row in backlog if row["stream"] == stream]
            assert seqs == sorted(seqs)
        fresh = shard_history()[1]
        publish(nats_url, [(None, fresh)])
        row = json.loads(_read_line(process, 15))
        next_shards_seq = 1 + sum(stream_for_subject(record["subject"]) == SHARDS_STREAM for record in records)
        assert row["seq"] == next_shards_seq and row["event"]["event_id"] == fresh.event_id
        assert consumer_counts(nats_url) == {SHARDS_STREAM: 1, PIPELINES_STREAM: 1}
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 130
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert consumer_counts(nats_url) == {SHARDS_STREAM: 0, PIPELINES_STREAM: 0}


def test_rebuild_diff_against_a_file_it_cannot_compare_says_so_in_one_line(nats_url, tmp_path):
    seed_examples(nats_url, dated_now=True)
    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"not a database " * 512)
    older = tmp_path / "older.sqlite"
    upgrade_database(older, "0015")

    for n, live in enumerate((corrupt, older)):
        result = replay(nats_url, "rebuild", "--db", str(tmp_path / f"new{n}.sqlite"), "--diff", str(live))
        assert result.exit_code == 2 and result.stderr.strip().count("\n") == 0, result.output
        assert str(live) in result.stderr and "Traceback" not in result.output
    assert corrupt.read_bytes() == b"not a database " * 512


def test_rebuild_onto_a_full_disk_says_so_in_one_line(nats_url, tmp_path):
    seed_examples(nats_url, dated_now=True)

    def cap(dbapi_connection, _record) -> None:
        dbapi_connection.execute("PRAGMA max_page_count = 4")

    event.listen(Engine, "connect", cap)
    try:
        result = replay(nats_url, "rebuild", "--db", str(tmp_path / "new.sqlite"))
    finally:
        event.remove(Engine, "connect", cap)
    assert result.exit_code == 1 and result.stderr.strip().count("\n") == 0, result.output
    assert "database or disk is full" in result.stderr


def test_rebuild_refuses_to_replace_the_read_model_it_is_asked_to_diff(nats_url, tmp_path):
    seed_examples(nats_url, dated_now=True)
    live = tmp_path / "live.sqlite"
    assert replay(nats_url, "rebuild", "--db", str(live)).exit_code == 0
    before = live.read_bytes()
    (tmp_path / "link.sqlite").symlink_to(live)

    for diff in (live, tmp_path / "link.sqlite"):
        result = replay(nats_url, "rebuild", "--db", str(live), "--force", "--diff", str(diff))
        assert result.exit_code == 2 and result.stderr.strip().count("\n") == 0, result.output
        assert "one file" in result.stderr
    assert live.read_bytes() == before

