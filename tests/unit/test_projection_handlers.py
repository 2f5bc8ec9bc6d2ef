"""Unit tests of the read-model projection: each handler's rows, exactly-once positions, determinism."""

from __future__ import annotations

import json
import random

import pytest
from sqlalchemy.orm import Session

from hearth.events.consume import SkippedMessage, decode_stored_message
from hearth.events.models import (
    IntegrityCorruptionDetected,
    PipelineAborted,
    PipelineCompleted,
    PipelineFailover,
    PipelineFallbackLocal,
    PipelineFirstToken,
    PipelineShardStatus,
    ShardWithdrawn,
    encode_event,
)
from hearth.events.streams import PIPELINES_STREAM, SHARDS_STREAM
from hearth.readmodels.pipeline_hops import hops_after_failover
from hearth.readmodels.positions import ConcurrentProjectionError, load_positions
from hearth.readmodels.projection import ReadModelProjection
from hearth.readmodels.batch_rows import epoch_s
from hearth.readmodels.tables import Failover, Pipeline, Shard, ShardHealth, ShardStats
from tests.readmodel_helpers import (
    T0,
    LogBuilder,
    advertised,
    apply_all,
    at,
    constructed,
    dump_rows,
    heartbeat,
    migrated_engine,
)


@pytest.fixture
def engine(tmp_path):
    engine = migrated_engine(tmp_path / "rm.db")
    yield engine
    engine.dispose()


def get(engine, model, key):
    with Session(engine) as session:
        return session.get(model, key)


def test_advertised_shard_row_and_expiry(engine):
    log = LogBuilder()
    shard = advertised(0, 3, "kitchen", t=0.7, ttl_s=90.5)
    apply_all(engine, [log.stored(shard)])
    row = get(engine, Shard, shard.shard_id)
    assert (row.layer_lo, row.layer_hi, row.node_id, row.status) == (0, 3, "kitchen", "advertised")
    assert row.advertised_at == epoch_s(T0) == int(T0.timestamp())
    assert row.expires_at == int(T0.timestamp() + 0.7 + 90.5)
    assert row.withdrawn_at is None


def test_withdrawn_then_readvertised(engine):
    log = LogBuilder()
    shard = advertised(0, 3, "kitchen")
    withdrawn = ShardWithdrawn(shard_id=shard.shard_id, reason="shutdown", node_id="kitchen", occurred_at=at(5))
    apply_all(engine, [log.stored(shard), log.stored(withdrawn)])
    row = get(engine, Shard, shard.shard_id)
    assert (row.status, row.withdrawn_at, row.withdrawn_reason) == ("withdrawn", epoch_s(at(5)), "shutdown")
    again = advertised(0, 3, "kitchen", t=10)
    apply_all(engine, [log.stored(again)])
    row = get(engine, Shard, shard.shard_id)
    assert (row.status, row.withdrawn_at, row.advertised_at) == ("advertised", None, epoch_s(at(10)))


def test_a_shard_advertised_again_after_leaving_has_no_measured_step_time(engine):
    log = LogBuilder()
    shard = advertised(0, 3, "kitchen")
    apply_all(engine, [log.stored(shard), log.stored(heartbeat(shard.shard_id, t=1, decode_step_ms=7.5))])
    assert get(engine, ShardHealth, shard.shard_id).decode_step_ms == 7.5
    apply_all(engine, [log.stored(advertised(0, 3, "kitchen", t=2))])  # re-advertised while it lives
    assert get(engine, ShardHealth, shard.shard_id).decode_step_ms == 7.5
    withdrawn = ShardWithdrawn(shard_id=shard.shard_id, reason="shutdown", node_id="kitchen", occurred_at=at(5))
    apply_all(engine, [log.stored(withdrawn), log.stored(advertised(0, 3, "kitchen", t=10))])
    assert get(engine, ShardHealth, shard.shard_id).decode_step_ms is None  # a new process: not measured yet


def test_an_old_event_replayed_later_changes_nothing(engine):
    """A correctly signed event re-published after the broker's de-duplication window is history, not news."""
    log = LogBuilder()
    first = advertised(0, 3, "kitchen", t=0)
    old_withdrawal = ShardWithdrawn(shard_id=first.shard_id, reason="shutdown", node_id="kitchen", occurred_at=at(5))
    readvertised = advertised(0, 3, "kitchen", t=30)
    apply_all(engine, [log.stored(first), log.stored(old_withdrawal), log.stored(readvertised)])
    assert get(engine, Shard, first.shard_id).status == "advertised"
    # Replayed: the withdrawal (t=5), the first advertisement (t=0), an old heartbeat.
    apply_all(engine, [log.stored(old_withdrawal), log.stored(first), log.stored(heartbeat(first.shard_id, t=40)),
                       log.stored(heartbeat(first.shard_id, t=10))])
    row = get(engine, Shard, first.shard_id)
    assert (row.status, row.advertised_at, row.withdrawn_at) == ("advertised", epoch_s(at(30)), None)
    assert get(engine, ShardHealth, first.shard_id).last_seen == epoch_s(at(40))


def test_heartbeats_keep_the_latest_values(engine):
    log = LogBuilder()
    shard = advertised(0, 3, "kitchen")
    apply_all(engine, [
        log.stored(shard),
        log.stored(heartbeat(shard.shard_id, t=1, queue_depth=3, active_streams=1, tokens=100)),
        log.stored(heartbeat(shard.shard_id, t=2, queue_depth=1, active_streams=2, tokens=250)),
    ])
    health = get(engine, ShardHealth, shard.shard_id)
    assert (health.last_seen, health.queue_depth, health.active_streams, health.tokens_served_total) == (
        epoch_s(at(2)), 1, 2, 250)
    assert get(engine, ShardStats, shard.shard_id).tokens_served == 250


def _pages_written(engine, messages) -> int:
    """The pages the write-ahead log takes for applying `messages` in one transaction."""
    with engine.connect() as connection:
        connection.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    apply_all(engine, messages)
    with engine.connect() as connection:
        return connection.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)").one()[1]


def test_a_heartbeat_writes_only_the_rows_it_changes_and_in_place(engine):
    """A heartbeat of a known shard changes figures, not keys: its rows are updated where they stand, so the
    write-ahead log takes one page per row it changed, and none of their key indexes (a row replaced whole is deleted
    and inserted again, and its key index page with it); a row it leaves as it was (an idle shard's shard_stats) is not
    written at all."""
    log = LogBuilder()
    shard = advertised(0, 3, "kitchen")
    apply_all(engine, [log.stored(shard), log.stored(heartbeat(shard.shard_id, t=1, tokens=100))])
    # shard_health, shard_stats, event_counts and the position.
    assert _pages_written(engine, [log.stored(heartbeat(shard.shard_id, t=2, queue_depth=1, tokens=250))]) == 4
    assert get(engine, ShardStats, shard.shard_id).tokens_served == 250
    # The same tokens served: shard_stats stays as it is.
    assert _pages_written(engine, [log.stored(heartbeat(shard.shard_id, t=3, tokens=250))]) == 3
    assert get(engine, ShardHealth, shard.shard_id).last_seen == epoch_s(at(3))


def test_pipeline_lifecycle_with_failover(engine):
    log = LogBuilder()
    a, b, c = "m:0-3@a", "m:4-7@b", "m:4-7@c"
    events = [
        constructed("p1", [a, b], t=2),
        PipelineFirstToken(pipeline_id="p1", ttft_ms=40.0, node_id="hub", occurred_at=at(3)),
        PipelineShardStatus(pipeline_id="p1", shard_id=b, status="degraded", reason="stalled", node_id="hub",
                            occurred_at=at(4)),
    ]
    apply_all(engine, [log.stored(e) for e in events])
    assert get(engine, Pipeline, "p1").status == "degraded"
    events = [
        PipelineFailover(pipeline_id="p1", failed_shard_id=b, replacement_hops=[c], reason="stalled",
                         resumed_at_token=5, node_id="hub", occurred_at=at(5)),
        PipelineCompleted(pipeline_id="p1", prompt_tokens=7, completion_tokens=9, duration_ms=800.0,
                          tokens_per_second=11.25, finish_reason="length", node_id="hub", occurred_at=at(6)),
    ]
    apply_all(engine, [log.stored(e) for e in events])
    row = get(engine, Pipeline, "p1")
    assert row.status == "completed"
    assert json.loads(row.hops) == [a, c]
    assert (row.failovers, row.ttft_ms, row.construct_ms, row.completion_tokens) == (1, 40.0, 3.5, 9)
    assert (row.constructed_at, row.first_token_at, row.finished_at) == (
        epoch_s(at(2)), epoch_s(at(3)), epoch_s(at(6)))
    assert (row.last_shard_status, row.last_shard_status_shard_id) == ("degraded", b)
    failover = get(engine, Failover, ("p1", 1))
    assert (failover.failed_shard_id, json.loads(failover.replacement_hops), failover.resumed_at_token) == (
        b, [c], 5)
    stats = {s: get(engine, ShardStats, s) for s in (a, b, c)}
    assert [stats[s].pipelines_joined for s in (a, b, c)] == [1, 1, 1]
    assert [stats[s].failovers_caused for s in (a, b, c)] == [0, 1, 0]


def test_aborted_and_fallback_pipelines(engine):
    log = LogBuilder()
    events = [
        constructed("p2", ["m:0-7@a"]),
        PipelineAborted(pipeline_id="p2", code="shard_unavailable", reason="no shard covers layers 4-7",
                        node_id="hub", occurred_at=at(3)),
        constructed("p3", ["m:0-7@a"]),
        PipelineFallbackLocal(pipeline_id="p3", reason="2 failovers", node_id="hub", occurred_at=at(4)),
        # A late status report must not resurrect an ended pipeline.
        PipelineShardStatus(pipeline_id="p2", shard_id="m:0-7@a", status="degraded", reason="late",
                            node_id="hub", occurred_at=at(5)),
    ]
    apply_all(engine, [log.stored(e) for e in events])
    aborted = get(engine, Pipeline, "p2")
    assert (aborted.status, aborted.error_code, aborted.finished_at) == ("aborted", "shard_unavailable",
                                                                          epoch_s(at(3)))
    fallback = get(engine, Pipeline, "p3")
    assert (fallback.status, fallback.fell_back_to_local, fallback.fallback_reason) == ("fallback_local", 1,
                                                                                       "2 failovers")
    assert get(engine, ShardStats, "m:0-7@a").pipelines_joined == 2


def test_corruption_detections_are_counted_per_shard(engine):
    log = LogBuilder()
    events = [
        IntegrityCorruptionDetected(pipeline_id="p4", shard_id="m:0-3@a", check=check, node_id="hub",
                                    occurred_at=at(i))
        for i, check in enumerate(["nan", "inf", "norm"])
    ]
    apply_all(engine, [log.stored(e) for e in events])
    assert get(engine, ShardStats, "m:0-3@a").corruption_detections == 3
    assert get(engine, Pipeline, "p4") is None


def test_redelivered_and_older_messages_are_no_ops(engine):
    log = LogBuilder()
    shard = advertised(0, 3, "kitchen")
    messages = [log.stored(shard), log.stored(constructed("p1", [shard.shard_id])),
                log.stored(constructed("p2", [shard.shard_id]))]
    assert apply_all(engine, messages) == 3
    before = dump_rows(engine)
    assert apply_all(engine, messages) == 0
    assert apply_all(engine, [messages[1]]) == 0
    assert dump_rows(engine) == before
    assert get(engine, ShardStats, shard.shard_id).pipelines_joined == 2
    with Session(engine) as session:
        assert load_positions(session) == {SHARDS_STREAM: 1, PIPELINES_STREAM: 2}


def test_undecodable_message_moves_the_position_only(engine):
    skipped = SkippedMessage(stream=PIPELINES_STREAM, seq=1, subject="hearth.events.pipeline.x.bogus",
                             time=T0, error="unknown type")
    assert apply_all(engine, [skipped]) == 1
    with Session(engine) as session:
        assert load_positions(session) == {PIPELINES_STREAM: 1}
    assert all(not rows for table, rows in dump_rows(engine, include_positions=False).items())


def _poisons() -> list[tuple[str, bytes]]:
    """Messages a member could publish that decode by JSON's rules but that no read model can hold."""
    advert = json.loads(encode_event(advertised(0, 3, "n1")))
    beat = json.loads(encode_event(heartbeat(advert["shard_id"])))
    return [
        ("a date an offset moves past the calendar",
         json.dumps({**advert, "occurred_at": "9999-12-31T23:59:59-05:00"})),
        ("a date before its first day", json.dumps({**advert, "occurred_at": "0001-01-01T00:00:00+05:00"})),
        ("an infinite TTL", json.dumps({**advert, "ttl_s": float("inf")})),
        ("a TTL past any calendar", json.dumps({**advert, "ttl_s": 1e19})),
        ("a NaN", json.dumps({**advert, "memory_required_mb": float("nan")})),
        ("a count past any column", json.dumps({**beat, "queue_depth": 2**63})),
        ("nesting past the JSON parser's depth", "[" * 100_000 + "]" * 100_000),
    ]


def test_messages_no_read_model_can_hold_are_skipped_not_applied(engine):
    messages = [decode_stored_message(SHARDS_STREAM, seq, "hearth.events.shard.x", T0, {}, data.encode())
                for seq, (_, data) in enumerate(_poisons(), start=1)]
    assert all(isinstance(message, SkippedMessage) for message in messages), [
        what for (what, _), message in zip(_poisons(), messages) if not isinstance(message, SkippedMessage)]
    assert apply_all(engine, messages) == len(messages)
    with Session(engine) as session:
        assert load_positions(session) == {SHARDS_STREAM: len(messages)}


def test_rows_and_position_roll_back_together(engine):
    log = LogBuilder()
    shard = advertised(0, 3, "kitchen")
    with pytest.raises(RuntimeError), Session(engine) as session, session.begin():
        assert ReadModelProjection().apply(session, log.stored(shard))
        raise RuntimeError("crash before commit")
    assert all(not rows for rows in dump_rows(engine).values())


def _sample_log():
    log = LogBuilder()
    a, b = advertised(0, 3, "a"), advertised(4, 7, "b")
    c = advertised(4, 7, "c", t=1)
    shard_events = [a, b, c, heartbeat(a.shard_id, tokens=10), heartbeat(b.shard_id, tokens=20),
                    ShardWithdrawn(shard_id=b.shard_id, reason="bye", node_id="b", occurred_at=at(9)),
                    heartbeat(a.shard_id, t=9, tokens=30)]
    pipeline_events = [
        constructed("p1", [a.shard_id, b.shard_id]),
        PipelineFirstToken(pipeline_id="p1", ttft_ms=12.0, node_id="hub", occurred_at=at(3)),
        PipelineFailover(pipeline_id="p1", failed_shard_id=b.shard_id, replacement_hops=[c.shard_id],
                         reason="stalled", resumed_at_token=2, node_id="hub", occurred_at=at(4)),
        IntegrityCorruptionDetected(pipeline_id="p1", shard_id=b.shard_id, check="nan", node_id="hub",
                                    occurred_at=at(4)),
        PipelineCompleted(pipeline_id="p1", prompt_tokens=3, completion_tokens=4, duration_ms=50.0,
                          tokens_per_second=80.0, finish_reason="stop", node_id="hub", occurred_at=at(5)),
    ]
    return [log.stored(e) for e in shard_events], [log.stored(e) for e in pipeline_events]


@pytest.mark.parametrize("seed", range(5))
def test_rows_do_not_depend_on_stream_interleaving_or_batching(tmp_path, seed):
    shard_messages, pipeline_messages = _sample_log()
    reference = migrated_engine(tmp_path / "reference.db")
    apply_all(reference, shard_messages + pipeline_messages)

    rng = random.Random(seed)
    queues = [list(shard_messages), list(pipeline_messages)]
    interleaved = []
    while any(queues):
        queue = rng.choice([q for q in queues if q])
        interleaved.append(queue.pop(0))
    shuffled = migrated_engine(tmp_path / "shuffled.db")
    position = 0
    while position < len(interleaved):
        size = rng.randint(1, 4)
        apply_all(shuffled, interleaved[position:position + size])
        position += size
    assert dump_rows(shuffled) == dump_rows(reference)
    reference.dispose()
    shuffled.dispose()


def test_hops_after_failover_splices_or_replaces():
    a, b, c = "m:0-3@a", "m:4-5@b", "m:6-7@c"
    x, y = "m:4-4@x", "m:5-5@y"
    # Only the failed shard's replacement: spliced in at its place.
    assert hops_after_failover([a, b, c], b, [x, y]) == [a, x, y, c]
    # A whole new chain: it repeats a surviving hop, or its layers span the chain, or nothing survives.
    assert hops_after_failover([a, b, c], b, [a, "m:4-7@z"]) == [a, "m:4-7@z"]
    assert hops_after_failover([a, b, c], b, ["m:0-7@z"]) == ["m:0-7@z"]
    assert hops_after_failover([b], b, [x, y]) == [x, y]
    assert hops_after_failover([], b, [x]) == [x]


def test_a_concurrent_projector_cannot_apply_the_same_event_twice(engine):
    """Two projectors on one file: the one whose stored position moved under it rolls its batch back."""
    log = LogBuilder()
    shard_id = "m:0-7@a"
    first, second = log.stored(constructed("p0", [shard_id])), log.stored(constructed("p1", [shard_id]))
    apply_all(engine, [first])

    class InterleavedProjection(ReadModelProjection):
        """Lets another projector commit the same event after this one has read its positions."""

        def handle(self, event, rows):
            apply_all(engine, [second])
            return super().handle(event, rows)

    with pytest.raises(ConcurrentProjectionError), Session(engine) as session, session.begin():
        InterleavedProjection().apply_many(session, [second])
    with Session(engine) as session:
        assert load_positions(session) == {PIPELINES_STREAM: 2}
    assert get(engine, ShardStats, shard_id).pipelines_joined == 2


def test_a_concurrent_projector_that_takes_the_first_position_first_is_a_concurrency_error(engine):
    """On a fresh file the other projector's first position, inserted meanwhile, is the same race as a moved one:
    ConcurrentProjectionError (retried from the positions), not an error of the message's (applied one by one)."""
    log = LogBuilder()
    first = log.stored(constructed("p0", ["m:0-7@a"]))

    class InterleavedProjection(ReadModelProjection):
        def handle(self, event, rows):
            apply_all(engine, [first])
            return super().handle(event, rows)

    with pytest.raises(ConcurrentProjectionError), Session(engine) as session, session.begin():
        InterleavedProjection().apply_many(session, [first])
    with Session(engine) as session:
        assert load_positions(session) == {PIPELINES_STREAM: 1}
    assert get(engine, ShardStats, "m:0-7@a").pipelines_joined == 1
