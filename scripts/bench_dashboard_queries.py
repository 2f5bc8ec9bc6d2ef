"""Times every SQL panel of the Grafana dashboards on a read model holding 100 000 pipeline events (target: < 50 ms).

    .venv/bin/python scripts/bench_dashboard_queries.py [--events 100000] [--hours 24] [--runs 7] [--seed 0]

Builds the read model through the real projection (readmodels.projection.ReadModelProjection, the handlers the
projector runs, in batches of 2 000 as it applies them): 12 shards (4 layer ranges x 3 replicas) heartbeating
every 10 s, and pipelines spread evenly over `--hours` (constructed, first token, 5 % failed over, 90 %
completed (every tenth call's verification unmet, the others met), 5 % aborted, 5 % fallen back to local) until
`--events` pipeline events are stored. 1 000 rejected_events rows are inserted directly (rejecting needs a roster;
the panel only reads the table).
Then each panel's SQL, expanded as the Grafana SQLite plugin expands it, runs `--runs` times on a read-only
connection over two time ranges: the whole data (every row in range, the worst case) and the last 6 hours
(Grafana's default). Prints a Markdown section for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy.orm import Session  # noqa: E402

from hearth.events.consume import StoredEvent  # noqa: E402
from hearth.events.models import (  # noqa: E402
    PipelineAborted,
    PipelineCompleted,
    PipelineConstructed,
    PipelineFailover,
    PipelineFallbackLocal,
    PipelineFirstToken,
    ShardAdvertised,
    ShardHeartbeat,
)
from hearth.events.streams import PIPELINES_STREAM, SHARDS_STREAM  # noqa: E402
from hearth.protocol.subjects import event_subject, shard_id_for  # noqa: E402
from hearth.readmodels.db import open_engine, upgrade_database  # noqa: E402
from hearth.readmodels.projection import ReadModelProjection  # noqa: E402
from hearth.services.common.sqlite_read_only import open_read_only  # noqa: E402
from hearth.services.dashboards.macros import TimeRange, run_panel_sql  # noqa: E402
from hearth.services.dashboards.panels import DASHBOARDS  # noqa: E402

MODEL = "bench/llama-8b"
RANGES = [(0, 7), (8, 15), (16, 23), (24, 31)]
REPLICAS = 3
HEARTBEAT_S = 10
BATCH = 2_000
T0 = datetime(2026, 11, 1, tzinfo=timezone.utc)


class Log:
    """Numbers events per stream as JetStream would."""

    def __init__(self) -> None:
        self.seqs = {SHARDS_STREAM: 0, PIPELINES_STREAM: 0}

    def stored(self, event) -> StoredEvent:
        stream = SHARDS_STREAM if event.type.startswith("shard.") else PIPELINES_STREAM
        self.seqs[stream] += 1
        return StoredEvent(stream=stream, seq=self.seqs[stream], subject=event_subject(event),
                           time=event.occurred_at, headers={}, event=event)


def shard_events(hours: float) -> list:
    events = []
    for lo, hi in RANGES:
        for replica in range(REPLICAS):
            node = f"host{lo:02d}{replica}"
            shard_id = shard_id_for(MODEL, lo, hi, node)
            for k in range(int(hours * 3600 / (HEARTBEAT_S * 30))):  # re-advertised every 30 heartbeats
                events.append(ShardAdvertised(
                    shard_id=shard_id, model_id=MODEL, weights_sha256="ab" * 32, layer_lo=lo, layer_hi=hi,
                    total_layers=32, dtype="bfloat16", memory_required_mb=4096.0, max_concurrent_streams=4,
                    control_subject=f"hearth.ctl.{node}.x", hop_weight=1.0 + replica, ttl_s=900.0, node_id=node,
                    occurred_at=T0 + timedelta(seconds=k * HEARTBEAT_S * 30)))
            for k in range(int(hours * 3600 / HEARTBEAT_S)):
                events.append(ShardHeartbeat(
                    shard_id=shard_id, queue_depth=k % 3, active_streams=k % 2, p95_latency_ms=8.0 + replica,
                    tokens_served_total=k * 40, node_id=node, occurred_at=T0 + timedelta(seconds=k * HEARTBEAT_S)))
    return sorted(events, key=lambda event: event.occurred_at)


def pipeline_events(target: int, hours: float, rng: random.Random) -> list:
    count = target // 3 + 1  # constructed, first token, an end (and 5 % failovers): cut to `target` below
    events: list = []
    for p in range(count):
        t = T0 + timedelta(seconds=hours * 3600 * p / count)
        pid = f"p{p}"
        hops = [shard_id_for(MODEL, lo, hi, f"host{lo:02d}{rng.randrange(REPLICAS)}") for lo, hi in RANGES]
        events += [
            PipelineConstructed(pipeline_id=pid, request_id=f"r{p}", model_id=MODEL, weights_sha256="ab" * 32,
                                hops=hops, construct_ms=rng.uniform(3, 30), node_id="hub", occurred_at=t),
            PipelineFirstToken(pipeline_id=pid, ttft_ms=rng.uniform(40, 400), node_id="hub",
                               occurred_at=t + timedelta(seconds=0.2)),
        ]
        fate = rng.random()
        if fate < 0.05:
            replacement = [shard_id_for(MODEL, *RANGES[1], "host080")]
            events.append(PipelineFailover(pipeline_id=pid, failed_shard_id=hops[1], replacement_hops=replacement,
                                           reason="gone", resumed_at_token=5, node_id="hub",
                                           occurred_at=t + timedelta(seconds=0.5)))
        end = t + timedelta(seconds=1.5)
        if fate < 0.90:
            events.append(PipelineCompleted(pipeline_id=pid, prompt_tokens=rng.randint(10, 400),
                                            completion_tokens=rng.randint(10, 256), duration_ms=1500.0,
                                            tokens_per_second=rng.uniform(5, 60), finish_reason="length",
                                            node_id="hub", occurred_at=end,
                                            verification="unmet" if p % 10 == 0 else "met"))
        elif fate < 0.95:
            events.append(PipelineAborted(pipeline_id=pid, code=rng.choice(["client_gone", "shard_unavailable"]),
                                          reason="bench", node_id="hub", occurred_at=end))
        else:
            events.append(PipelineFallbackLocal(pipeline_id=pid, reason="bench", node_id="hub", occurred_at=end))
    return events[:target]


def build(path: Path, events: int, hours: float, seed: int) -> tuple[int, float]:
    upgrade_database(path)
    engine = open_engine(path)
    projection = ReadModelProjection()
    log = Log()
    timed = sorted(shard_events(hours) + pipeline_events(events, hours, random.Random(seed)),
                   key=lambda event: event.occurred_at)
    started = time.perf_counter()
    for start in range(0, len(timed), BATCH):
        with Session(engine) as session, session.begin():
            projection.apply_many(session, [log.stored(event) for event in timed[start:start + BATCH]])
    projected_s = time.perf_counter() - started
    with engine.begin() as connection:
        rows = [("HEARTH_SHARDS", 10_000_000 + n, f"e{n}", "shard.advertised", "intruder", None,
                 "unsigned", int(T0.timestamp()) + n * 60, int(T0.timestamp()) + n * 60) for n in range(1000)]
        connection.exec_driver_sql("INSERT INTO rejected_events VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    engine.dispose()
    return log.seqs[PIPELINES_STREAM], projected_s


def time_panels(path: Path, time_range: TimeRange, runs: int) -> list[tuple[str, str, float, float, float, int]]:
    """Per panel: median and max wall ms, median CPU ms of this thread (the query's own work when the machine
    is shared), rows."""
    results = []
    with contextlib.closing(open_read_only(path)) as connection:
        for dashboard in DASHBOARDS:
            for panel in dashboard.sql_panels:
                walls, cpus = [], []
                for _ in range(runs):
                    wall, cpu = time.perf_counter(), time.thread_time()
                    _columns, rows = run_panel_sql(connection, panel.sql, time_range)
                    walls.append((time.perf_counter() - wall) * 1000)
                    cpus.append((time.thread_time() - cpu) * 1000)
                results.append((dashboard.title, panel.title, statistics.median(walls), max(walls),
                                statistics.median(cpus), len(rows)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000, help="pipeline events in the read model")
    parser.add_argument("--hours", type=float, default=24.0, help="hours the events are spread over")
    parser.add_argument("--runs", type=int, default=7, help="runs of each query (median and max reported)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "readmodel.sqlite"
        stored, projected_s = build(path, args.events, args.hours, args.seed)
        with contextlib.closing(sqlite3.connect(path)) as connection:
            pipelines = connection.execute("SELECT COUNT(*) FROM pipelines").fetchone()[0]
        end_s = int(T0.timestamp() + args.hours * 3600)
        ranges = {"whole data": TimeRange(int(T0.timestamp()), end_s), "last 6 h": TimeRange(end_s - 6 * 3600, end_s)}
        timings = {name: time_panels(path, time_range, args.runs) for name, time_range in ranges.items()}
        size_mb = path.stat().st_size / 1e6
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"Read model: {stored} pipeline events ({pipelines} pipelines) over {args.hours:g} h, plus 12 shards' "
          f"heartbeats, projected in {projected_s:.1f} s; {size_mb:.1f} MB. Python {platform.python_version()}, "
          f"SQLite {sqlite3.sqlite_version}, {platform.machine()}, {os.cpu_count()} cores, load {load:.1f}.\n")
    print("ms per query, median of the runs: wall / CPU (max wall) [rows]\n")
    print("| dashboard | panel | whole data | last 6 h |")
    print("|---|---|---|---|")
    for whole, recent in zip(timings["whole data"], timings["last 6 h"]):
        print(f"| {whole[0]} | {whole[1]} | {whole[2]:.1f} / {whole[4]:.1f} ({whole[3]:.1f}) [{whole[5]}] | "
              f"{recent[2]:.1f} / {recent[4]:.1f} ({recent[3]:.1f}) [{recent[5]}] |")
    for name, rows in timings.items():
        print(f"\n{name}: slowest median wall {max(row[2] for row in rows):.1f} ms, slowest median CPU "
              f"{max(row[4] for row in rows):.1f} ms, slowest single run {max(row[3] for row in rows):.1f} ms "
              "(target: < 50 ms).")


if __name__ == "__main__":
    main()
