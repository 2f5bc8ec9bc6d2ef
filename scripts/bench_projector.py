"""Benchmarks the read-model projector: catch-up throughput over N stored events, and a full rebuild.

    .venv/bin/python scripts/bench_projector.py [--events 100000] [--seed 0]

Starts a fresh embedded nats-server, loads N events with a realistic mix (mostly heartbeats, then pipeline
lifecycles with some failovers, aborts, fallbacks and corruption reports), then measures
1. the projector (readmodels.runner.Projector, as `hearth projector` runs it) catching up from an empty
   database until both streams are applied: events/s;
2. `rebuild_database` of the same log into a fresh file: seconds (and events/s);
3. with `--prune`, the retention policy of `[readmodels]` pruning the projected database once its log's clock has
   passed every event by more than the pipelines stream's retention (a projector back after long away): rows/s,
   the free pages given back to the disk included, and the file's size before and after;
and checks that both databases hold identical rows. Prints a Markdown section for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path

from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hearth.events.models import (  # noqa: E402
    IntegrityCorruptionDetected,
    PipelineAborted,
    PipelineCompleted,
    PipelineConstructed,
    PipelineFailover,
    PipelineFallbackLocal,
    PipelineFirstToken,
    PipelineShardStatus,
    ShardAdvertised,
    ShardHeartbeat,
    encode_event,
)
from hearth.events.publish import MSG_ID_HEADER  # noqa: E402
from hearth.events.streams import ensure_streams  # noqa: E402
from hearth.protocol.subjects import event_subject, shard_id_for  # noqa: E402
from hearth.readmodels.db import open_engine, session_factory  # noqa: E402
from hearth.readmodels.positions import PROJECTION_NAME  # noqa: E402
from hearth.readmodels.rebuild import diff_databases, rebuild_database  # noqa: E402
from hearth.readmodels.retention import prune_all, retention_policy  # noqa: E402
from hearth.readmodels.runner import Projector  # noqa: E402
from hearth.services.broker.connection import connect_nats  # noqa: E402
from hearth.services.broker.server import EmbeddedNatsServer  # noqa: E402
from hearth.services.common.config import ReadModelSettings  # noqa: E402

model_id = "bench/model-24l"
weights = "ee" * 32
total_layers = 24
# Enough shards that no heartbeat subject reaches the stream's per-subject cap: the whole log stays stored.
shard_count = 96
# Chance that the next event is a heartbeat; a pipeline adds ~3.2 events, so ~70 % of events are heartbeats.
heartbeat_step_share = 0.88
catch_up_timeout_s = 600.0


def realistic_events(n: int, seed: int) -> list:
    """About 70 % heartbeats from 96 shards, the rest pipeline lifecycles; exactly n events, time-ordered."""
    rng = random.Random(seed)
    t0 = datetime(2026, 11, 21, tzinfo=timezone.utc)
    shards = []
    for i in range(shard_count):
        lo = (i % 3) * 8
        node = f"node{i}"
        shard_id = shard_id_for(model_id, lo, lo + 7, node)
        shards.append(ShardAdvertised(
            shard_id=shard_id, model_id=model_id, weights_sha256=weights, layer_lo=lo, layer_hi=lo + 7,
            total_layers=total_layers, dtype="bfloat16", memory_required_mb=400, max_concurrent_streams=4,
            control_subject=f"hearth.ctl.{node}.s{i}", hop_weight=1.0 + (i % 4) * 0.5, ttl_s=120,
            node_id=node, occurred_at=t0))
    by_range = [[s.shard_id for s in shards if s.layer_lo == lo] for lo in (0, 8, 16)]
    events: list = list(shards)
    tokens = Counter()
    t = t0
    pipeline_number = 0
    while len(events) < n:
        t += timedelta(milliseconds=50)
        if rng.random() < heartbeat_step_share:
            shard = rng.choice(shards)
            tokens[shard.shard_id] += rng.randint(0, 40)
            events.append(ShardHeartbeat(
                shard_id=shard.shard_id, queue_depth=rng.randint(0, 3), active_streams=rng.randint(0, 3),
                p95_latency_ms=rng.uniform(10, 80), tokens_served_total=tokens[shard.shard_id],
                node_id=shard.node_id, occurred_at=t))
            continue
        pipeline_number += 1
        pid = f"p{seed}x{pipeline_number}"
        hops = [rng.choice(group) for group in by_range]
        life = [
            PipelineConstructed(pipeline_id=pid, request_id=f"r{pipeline_number}", model_id=model_id,
                                weights_sha256=weights, hops=hops, construct_ms=rng.uniform(1, 9), node_id="hub",
                                occurred_at=t),
            PipelineFirstToken(pipeline_id=pid, ttft_ms=rng.uniform(50, 400), node_id="hub", occurred_at=t),
        ]
        fate = rng.random()
        if fate < 0.08:
            replacement = rng.choice([s for s in by_range[2] if s != hops[2]])
            life += [
                PipelineShardStatus(pipeline_id=pid, shard_id=hops[2], status="degraded", reason="stalled",
                                    node_id="hub", occurred_at=t),
                PipelineFailover(pipeline_id=pid, failed_shard_id=hops[2], replacement_hops=[replacement],
                                 reason="stalled", resumed_at_token=rng.randint(1, 30), node_id="hub",
                                 occurred_at=t),
            ]
        if fate < 0.02:
            life.append(IntegrityCorruptionDetected(pipeline_id=pid, shard_id=hops[1], check="nan",
                                                    node_id="hub", occurred_at=t))
        if 0.08 <= fate < 0.1:
            life.append(PipelineAborted(pipeline_id=pid, code="shard_unavailable", reason="no repick",
                                        node_id="hub", occurred_at=t))
        elif 0.1 <= fate < 0.12:
            life.append(PipelineFallbackLocal(pipeline_id=pid, reason="2 failovers", node_id="hub", occurred_at=t))
        else:
            life.append(PipelineCompleted(pipeline_id=pid, prompt_tokens=rng.randint(5, 300),
                                          completion_tokens=rng.randint(1, 256), duration_ms=rng.uniform(200, 9000),
                                          tokens_per_second=rng.uniform(3, 30), finish_reason="stop",
                                          node_id="hub", occurred_at=t))
        events.extend(life)
    return events[:n]


async def load(js, events: list) -> float:
    started = time.perf_counter()
    acks = []
    for event in events:
        # publish_async keeps the publish order on the wire; each ack is awaited below.
        acks.append(await js.publish_async(event_subject(event), encode_event(event),
                                           headers={MSG_ID_HEADER: event.event_id}))
        if len(acks) >= 2000:
            await asyncio.gather(*acks)
            acks = []
    await asyncio.gather(*acks)
    return time.perf_counter() - started


async def bench(n: int, seed: int, prune: bool = False) -> dict:
    events = realistic_events(n, seed)
    mix = Counter(e.type for e in events)
    with EmbeddedNatsServer() as server, tempfile.TemporaryDirectory(prefix="hearth-bench-") as tmp:
        nc = await connect_nats(server.url, name="bench-projector")
        js = nc.jetstream()
        await ensure_streams(js)
        load_s = await load(js, events)

        live = Path(tmp) / "live.db"
        started, cpu_started = time.perf_counter(), time.process_time()
        projector = Projector(live, js)
        await projector.start()
        stored = sum((await projector.wait_until_caught_up(catch_up_timeout_s)).values())
        project_s, project_cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
        projected = sum(projector.applied_total.values())
        batches = projector.batches_total
        await projector.stop()

        rebuilt = Path(tmp) / "rebuilt.db"
        started, cpu_started = time.perf_counter(), time.process_time()
        applied = await rebuild_database(js, rebuilt)
        rebuild_s, rebuild_cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
        differences = diff_databases(rebuilt, live, include_positions=True)
        await nc.close()
        pruned, prune_s, sizes = prune_long_after(live) if prune else (0, 0.0, (0, 0))
    return dict(pruned=pruned, prune_s=prune_s, sizes=sizes, n=n, mix=mix, load_s=load_s, stored=stored, projected=projected, project_s=project_s,
                project_cpu_s=project_cpu_s, batches=batches, rebuild_s=rebuild_s, rebuild_cpu_s=rebuild_cpu_s,
                applied=applied, differences=len(differences), load_average=os.getloadavg())


def prune_long_after(db: Path) -> tuple[int, float, tuple[int, int]]:
    """Rows the default retention prunes from `db` once its log's clock stands a retention past its last event, the
    seconds it took (short transactions, as a projector's pruning task runs them), and the file's bytes before and
    after (each once closed, its WAL checkpointed)."""
    policy = retention_policy(ReadModelSettings())
    size_before = db.stat().st_size
    engine = open_engine(db)
    sessions = session_factory(engine)
    try:
        with sessions() as session, session.begin():
            session.execute(text("UPDATE projection_positions SET last_event_at = last_event_at + :later"),
                            {"later": int((policy.pipelines_retention_days + 1) * 86_400)})
        started = time.perf_counter()
        pruned = prune_all(sessions, policy, PROJECTION_NAME)
        prune_s = time.perf_counter() - started
    finally:
        engine.dispose()
    return pruned, prune_s, (size_before, db.stat().st_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prune", action="store_true", help="also time the retention's pruning of the read model")
    args = parser.parse_args()
    result = asyncio.run(bench(args.events, args.seed, args.prune))
    n = result["n"]
    heartbeats = result["mix"]["shard.heartbeat"]
    print(f"## Projector ({time.strftime('%Y-%m-%d')})\n")
    print(f"Command: `.venv/bin/python scripts/bench_projector.py --events {n} --seed {args.seed}`  ")
    print(f"Machine: {platform.machine()}, {platform.python_implementation()} {platform.python_version()}, "
          f"SQLite WAL + synchronous=NORMAL, nats-server with sync_interval: always.\n")
    print(f"- log: {n} events ({heartbeats / n:.0%} heartbeats, "
          f"{result['mix']['pipeline.constructed']} pipelines), loaded in {result['load_s']:.1f} s; "
          f"last sequences sum to {result['stored']}")
    print(f"- projector catch-up from an empty database: {result['projected']} events in {result['project_s']:.2f} s "
          f"= **{result['projected'] / result['project_s']:,.0f} events/s** ({result['batches']} transactions, "
          f"start-up and migration included; {result['project_cpu_s']:.2f} s CPU in this process)")
    print(f"- rebuild of the whole log into a fresh database: {result['applied']} events in "
          f"**{result['rebuild_s']:.2f} s** ({result['applied'] / result['rebuild_s']:,.0f} events/s; "
          f"{result['rebuild_cpu_s']:.2f} s CPU)")
    print(f"- rows differing between projector and rebuild: {result['differences']}")
    if args.prune:
        print(f"- the default retention pruning the projected database once its log's clock stands past every "
              f"event: {result['pruned']} rows in **{result['prune_s']:.2f} s** "
              f"({result['pruned'] / max(result['prune_s'], 1e-9):,.0f} rows/s); the file "
              f"{result['sizes'][0] / 2**20:.1f} MiB before, {result['sizes'][1] / 2**20:.1f} MiB after")
    print(f"- 1/5/15-min load average at the end (the 2 cores are shared): "
          f"{' / '.join(f'{x:.1f}' for x in result['load_average'])}")


if __name__ == "__main__":
    main()
