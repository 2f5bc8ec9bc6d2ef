"""Test helpers for the read models: Alembic-migrated temp databases, event factories and row dumps."""

from __future__ import annotations

from types import SimpleNamespace

import contextlib
import itertools
import sqlite3
from datetime import datetime, timedelta, timezone
from pathlib import Path

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from hearth.events.consume import StoredEvent
from hearth.events.models import (
    PipelineConstructed,
    ShardAdvertised,
    ShardHeartbeat,
)
from hearth.events.streams import PIPELINES_STREAM, SHARDS_STREAM
from hearth.protocol.mesh_protocol import MESH_PROTOCOL
from hearth.protocol.subjects import event_subject, shard_id_for
from hearth.readmodels.db import open_engine, upgrade_database
from hearth.readmodels.rebuild import UNCOMPARED_COLUMNS
from hearth.readmodels.projection import ReadModelProjection
from hearth.readmodels.tables import Base

MODEL_ID = "tiny/llama-test"
MODEL_LAYERS = 8  # what advertised() says the model has
# What a loaded head's `info` tells of that model (for stand-ins of an orchestrator's LoadedModel).
MODEL_INFO = SimpleNamespace(num_layers=MODEL_LAYERS)
WEIGHTS_SHA = "ab" * 32
# Noon yesterday: recent, because a projector with a retention policy refuses an event older than it keeps history by
# when the stream stored it (too_old, readmodels.applied_events), and a real stream stores a test's events now.
T0 = (datetime.now(timezone.utc) - timedelta(days=1)).replace(hour=12, minute=0, second=0, microsecond=0)


def migrated_engine(path: Path) -> Engine:
    upgrade_database(path)
    return open_engine(path)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def advertised(lo: int, hi: int, node: str, *, total: int = MODEL_LAYERS, t: float = 0.0,
               **overrides) -> ShardAdvertised:
    shard_id = shard_id_for(overrides.pop("model_id", MODEL_ID), lo, hi, node,
                            quantization=overrides.get("quantization", "none"))
    fields = dict(
        shard_id=shard_id,
        model_id=shard_id.split(":")[0],
        weights_sha256=WEIGHTS_SHA,
        layer_lo=lo,
        layer_hi=hi,
        total_layers=total,
        dtype="float32",
        memory_required_mb=10.0,
        max_concurrent_streams=2,
        control_subject=f"hearth.ctl.{node}.x{lo}",
        hop_weight=1.0,
        ttl_s=120.0,
        node_id=node,
        occurred_at=at(t),
        protocol=MESH_PROTOCOL,  # a shard of this hearth
    )
    fields.update(overrides)
    return ShardAdvertised(**fields)


def heartbeat(shard_id: str, *, t: float = 1.0, queue_depth: int = 0, active_streams: int = 0,
              tokens: int = 0, node: str = "n", decode_step_ms: float | None = None) -> ShardHeartbeat:
    return ShardHeartbeat(
        shard_id=shard_id, queue_depth=queue_depth, active_streams=active_streams, p95_latency_ms=12.5,
        tokens_served_total=tokens, node_id=node, occurred_at=at(t), decode_step_ms=decode_step_ms,
    )


def constructed(pipeline_id: str, hops: list[str], *, t: float = 2.0) -> PipelineConstructed:
    return PipelineConstructed(
        pipeline_id=pipeline_id, request_id=f"r-{pipeline_id}", model_id=MODEL_ID, weights_sha256=WEIGHTS_SHA,
        hops=hops, construct_ms=3.5, node_id="hub", occurred_at=at(t),
    )


def stream_of(event) -> str:
    return SHARDS_STREAM if event.type.startswith("shard.") else PIPELINES_STREAM


class LogBuilder:
    """Numbers events per stream the way JetStream would, producing StoredEvents."""

    def __init__(self) -> None:
        self._seqs = {SHARDS_STREAM: itertools.count(1), PIPELINES_STREAM: itertools.count(1)}

    def stored(self, event) -> StoredEvent:
        stream = stream_of(event)
        return StoredEvent(
            stream=stream, seq=next(self._seqs[stream]), subject=event_subject(event),
            time=event.occurred_at, headers={"Nats-Msg-Id": event.event_id}, event=event,
        )


def apply_all(engine: Engine, messages, projection: ReadModelProjection | None = None) -> int:
    projection = projection or ReadModelProjection()
    with Session(engine) as session, session.begin():
        return projection.apply_many(session, messages)


def dump_rows(engine: Engine, *, include_positions: bool = True) -> dict[str, list[tuple]]:
    """Every row of every read-model table, sorted, for whole-database equality checks."""
    dump: dict[str, list[tuple]] = {}
    with engine.connect() as connection:
        for table in Base.metadata.sorted_tables:
            if table.name == "projection_positions" and not include_positions:
                continue
            columns = [column for column in table.columns
                       if column.name not in UNCOMPARED_COLUMNS.get(table.name, ())]
            dump[table.name] = sorted(tuple(row) for row in connection.execute(select(*columns)))
    return dump


def synthetic_events(*, shards: int = 4, pipelines: int = 20, heartbeats_per_shard: int = 10,
                     seed: int = 0, t0: float = 0.0) -> list:
    """A realistic, deterministic mix: shards advertise, heartbeat a lot, pipelines run (some fail over,
    abort, fall back or see corruption), one shard withdraws. Ordered by occurred_at."""
    import random

    from hearth.events.models import (
        IntegrityCorruptionDetected,
        PipelineAborted,
        PipelineCompleted,
        PipelineFailover,
        PipelineFallbackLocal,
        PipelineFirstToken,
        PipelineShardStatus,
        ShardWithdrawn,
    )

    rng = random.Random(seed)
    half = 4
    shard_events = [advertised(0 if i % 2 == 0 else half, half - 1 if i % 2 == 0 else 2 * half - 1, f"node{i}",
                               total=2 * half, t=t0 + i * 0.01) for i in range(shards)]
    ids = [e.shard_id for e in shard_events]
    timed: list[tuple[float, object]] = [(e.occurred_at.timestamp(), e) for e in shard_events]
    for k in range(heartbeats_per_shard):
        for i, shard_id in enumerate(ids):
            t = t0 + 1 + k * 0.5 + i * 0.001
            timed.append((at(t).timestamp(), heartbeat(shard_id, t=t, queue_depth=rng.randint(0, 3),
                                                       active_streams=rng.randint(0, 1), tokens=k * 37 + i,
                                                       node=f"node{i}")))
    lows, highs = ids[0::2], ids[1::2]
    for p in range(pipelines):
        t = t0 + 1 + p * 0.3
        pid = f"p{seed}-{p}"
        hops = [rng.choice(lows), rng.choice(highs)]
        events = [constructed(pid, hops, t=t),
                  PipelineFirstToken(pipeline_id=pid, ttft_ms=rng.uniform(5, 50), node_id="hub",
                                     occurred_at=at(t + 0.05))]
        fate = rng.random()
        if fate < 0.15:
            replacement = [h for h in highs if h != hops[1]][:1] or [hops[1]]
            events += [
                PipelineShardStatus(pipeline_id=pid, shard_id=hops[1], status="degraded", reason="stalled",
                                    node_id="hub", occurred_at=at(t + 0.1)),
                PipelineFailover(pipeline_id=pid, failed_shard_id=hops[1], replacement_hops=replacement,
                                 reason="stalled", resumed_at_token=3, node_id="hub", occurred_at=at(t + 0.11)),
            ]
        if fate < 0.05:
            events.append(IntegrityCorruptionDetected(pipeline_id=pid, shard_id=hops[0], check="norm",
                                                      node_id="hub", occurred_at=at(t + 0.12)))
        if 0.15 <= fate < 0.2:
            events.append(PipelineAborted(pipeline_id=pid, code="pipeline_stalled", reason="stalled twice",
                                          node_id="hub", occurred_at=at(t + 0.2)))
        elif 0.2 <= fate < 0.25:
            events.append(PipelineFallbackLocal(pipeline_id=pid, reason="no repick", node_id="hub",
                                                occurred_at=at(t + 0.2)))
        else:
            events.append(PipelineCompleted(pipeline_id=pid, prompt_tokens=rng.randint(5, 50),
                                            completion_tokens=rng.randint(1, 64), duration_ms=rng.uniform(50, 900),
                                            tokens_per_second=rng.uniform(5, 40), finish_reason="length",
                                            node_id="hub", occurred_at=at(t + 0.2),
                                            verification=(None, "met", "unmet")[p % 3]))
        timed += [(e.occurred_at.timestamp(), e) for e in events]
    if shards > 2:
        timed.append((at(t0 + 10_000).timestamp(), ShardWithdrawn(shard_id=ids[-1], reason="shutdown",
                                                                  node_id="nodex", occurred_at=at(t0 + 10_000))))
    timed.sort(key=lambda pair: pair[0])
    return [event for _, event in timed]


class PoisonedProjection(ReadModelProjection):
    """The read-model projection, but its handler raises `error` on one event, as a handler's bug or a value that no
    table column takes would."""

    def __init__(self, poison_event_id: str, error: Exception) -> None:
        super().__init__()
        self.poison_event_id = poison_event_id
        self.error = error
        self.raised = 0

    def handle(self, event, rows):
        if event.event_id == self.poison_event_id:
            self.raised += 1
            raise self.error
        return super().handle(event, rows)


def with_a_damaged_table(path: Path, table: str) -> Path:
    """A migrated read model whose `table`'s root page is overwritten: SQLite opens the file and reads its schema,
    and finds it malformed only on touching that table."""
    upgrade_database(path)
    with contextlib.closing(sqlite3.connect(path)) as connection:
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        root = connection.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0]
        page_size = connection.execute("PRAGMA page_size").fetchone()[0]
    data = bytearray(path.read_bytes())
    data[(root - 1) * page_size:root * page_size] = b"\x07" * page_size
    path.write_bytes(bytes(data))
    return path


def keys_in(path: Path, table: str, column: str) -> list:
    """`column` of every row of `table` in the read model at `path` (none while it is not migrated yet)."""
    with contextlib.closing(sqlite3.connect(path)) as connection:
        try:
            return [row[0] for row in connection.execute(f"SELECT {column} FROM {table}")]
        except sqlite3.OperationalError:
            return []
