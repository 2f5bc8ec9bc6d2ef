"""hearth-replay's pure parts: durations, times, type/subject filters, stream selection, pipeline and shard views."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from hearth.events.consume import StoredEvent
from hearth.events.models import (
    PipelineCompleted,
    PipelineConstructed,
    PipelineFailover,
    PipelineFirstToken,
    ShardAdvertised,
    ShardHeartbeat,
    ShardWithdrawn,
)
from hearth.events.streams import MEMBER_REMOVAL_SUBJECTS, PIPELINES_STREAM, SHARDS_STREAM
from hearth.protocol.subjects import event_subject
from hearth.services.replay.query import (
    QueryError,
    StreamSelection,
    parse_duration,
    parse_timestamp,
    select_streams,
    subjects_for_type,
    subject_is_subset,
    subjects_collide,
    type_matches,
)
from hearth.services.replay.reports import heartbeat_gaps, pipeline_outcome, pipeline_timeline, shard_report

T0 = datetime(2026, 11, 21, 12, 0, 0, tzinfo=timezone.utc)
SHARD = "tiny/m:0-3@node-a"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def stored(event, seq: int) -> StoredEvent:
    stream = SHARDS_STREAM if event.type.startswith("shard.") else PIPELINES_STREAM
    return StoredEvent(stream=stream, seq=seq, subject=event_subject(event), time=event.occurred_at, headers={},
                       event=event)


def advertised(t: float) -> ShardAdvertised:
    return ShardAdvertised(
        node_id="node-a", occurred_at=at(t), shard_id=SHARD, model_id="tiny/m", weights_sha256="ab" * 32,
        layer_lo=0, layer_hi=3, total_layers=8, dtype="float32", memory_required_mb=1, max_concurrent_streams=2,
        control_subject="hearth.ctl.node-a.x", ttl_s=60,
    )


def beat(t: float, served: int = 0) -> ShardHeartbeat:
    return ShardHeartbeat(node_id="node-a", occurred_at=at(t), shard_id=SHARD, queue_depth=0, active_streams=0,
                          p95_latency_ms=2.0, tokens_served_total=served)


@pytest.mark.parametrize(
    "text, seconds",
    [("90s", 90), ("15m", 900), ("2h", 7200), ("1d", 86400), ("1h30m", 5400), ("0.5s", 0.5), ("1w", 604800)],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "15", "m", "5x", "1h 3", "-5m"])
def test_parse_duration_rejects_nonsense(text):
    with pytest.raises(QueryError):
        parse_duration(text)


def test_parse_timestamp_accepts_rfc3339_and_treats_naive_times_as_utc():
    assert parse_timestamp("2026-11-21T12:00:00Z") == T0
    assert parse_timestamp("2026-11-21T13:00:00+01:00") == T0
    assert parse_timestamp("2026-11-21T12:00:00") == T0
    with pytest.raises(QueryError):
        parse_timestamp("yesterday")


def test_types_map_to_subject_filters():
    assert subjects_for_type("pipeline.completed") == ("hearth.events.pipeline.*.completed",)
    assert subjects_for_type("shard.heartbeat") == ("hearth.events.shard.*.*.heartbeat",)
    assert subjects_for_type("integrity.corruption_detected") == ("hearth.events.integrity.*.corruption_detected",)
    assert subjects_for_type("shard") == ("hearth.events.shard.>",)
    with pytest.raises(QueryError, match="unknown event type"):
        subjects_for_type("shard.exploded")
    assert type_matches("shard.heartbeat", ["shard"]) and type_matches("shard.heartbeat", [])
    assert not type_matches("shard.heartbeat", ["shard.advertised", "pipeline"])


def test_a_removal_is_found_on_the_subject_it_has_in_each_stream():
    """`--type member.removed` (or `member`) reads both streams, where the steward publishes a removal: not the
    subject its family would give it, which no stream holds."""
    for wanted in ("member.removed", "member"):
        selections = select_streams(types=[wanted])
        assert {selection.stream for selection in selections} == {SHARDS_STREAM, PIPELINES_STREAM}
        for selection in selections:
            assert selection.filters == (MEMBER_REMOVAL_SUBJECTS[selection.stream],)


def test_subject_algebra():
    assert subject_is_subset("hearth.events.shard.ab.heartbeat", "hearth.events.shard.>")
    assert subject_is_subset("hearth.events.shard.>", "hearth.events.>")
    assert subject_is_subset("hearth.events.shard.>", ">")
    assert not subject_is_subset("hearth.events.>", "hearth.events.shard.>")
    assert not subject_is_subset("hearth.events.shard", "hearth.events.shard.>")
    assert subjects_collide("hearth.events.*.*.completed", "hearth.events.pipeline.>")
    assert not subjects_collide("hearth.events.shard.>", "hearth.events.pipeline.>")
    assert not subjects_collide("a.b", "a.b.c")


def test_select_streams_reads_only_the_streams_a_filter_can_match():
    both = select_streams()
    assert both == [StreamSelection(SHARDS_STREAM), StreamSelection(PIPELINES_STREAM)]
    assert select_streams(types=["shard.withdrawn"]) == [
        StreamSelection(SHARDS_STREAM, ("hearth.events.shard.*.*.withdrawn",))
    ]
    assert select_streams(types=["pipeline", "integrity"]) == [StreamSelection(PIPELINES_STREAM)]
    assert select_streams(subject="hearth.events.>") == both
    assert select_streams(subject="hearth.events.*.*.completed") == [
        StreamSelection(SHARDS_STREAM, ("hearth.events.*.*.completed",)),
        StreamSelection(PIPELINES_STREAM, ("hearth.events.*.*.completed",)),
    ]
    assert select_streams([SHARDS_STREAM], types=["pipeline.completed"]) == []
    with pytest.raises(QueryError, match="unknown stream"):
        select_streams(["NOPE"])


def test_pipeline_timeline_is_relative_to_the_first_event():
    events = [
        stored(PipelineConstructed(node_id="hub", occurred_at=at(0), pipeline_id="p-1", request_id="r",
                                   model_id="tiny/m", weights_sha256="ab", hops=["s1", "s2"], construct_ms=3.0), 1),
        stored(PipelineFirstToken(node_id="hub", occurred_at=at(0.25), pipeline_id="p-1", ttft_ms=250.0), 2),
        stored(PipelineFailover(node_id="hub", occurred_at=at(1.5), pipeline_id="p-1", failed_shard_id="s2",
                                replacement_hops=["s3"], reason="stalled", resumed_at_token=4), 3),
        stored(PipelineCompleted(node_id="hub", occurred_at=at(3), pipeline_id="p-1", prompt_tokens=5,
                                 completion_tokens=8, duration_ms=3000, tokens_per_second=2.7,
                                 finish_reason="length"), 4),
    ]
    lines = pipeline_timeline("p-1", events)
    assert lines[0].startswith("pipeline p-1: 4 events")
    assert lines[1].split()[:2] == ["+0.000s", "pipeline.constructed"] and "hops=[s1, s2]" in lines[1]
    assert lines[2].split()[:2] == ["+0.250s", "pipeline.first_token"]
    assert lines[3].split()[:2] == ["+1.500s", "pipeline.failover"] and "failed_shard_id=s2" in lines[3]
    assert lines[4].split()[:2] == ["+3.000s", "pipeline.completed"]
    assert all("pipeline_id" not in line for line in lines[1:])
    assert pipeline_outcome(events) == "completed"
    assert pipeline_outcome(events[:3]) == "running"


def test_heartbeat_gaps_longer_than_the_timeout_are_found_and_a_withdrawal_ends_the_watch():
    events = [stored(e, i) for i, e in enumerate(
        [advertised(0), beat(5), beat(10), beat(50), beat(55), ShardWithdrawn(
            node_id="node-a", occurred_at=at(60), shard_id=SHARD, reason="shutdown")], start=1)]
    gaps = heartbeat_gaps(events, 30, now=at(1000))
    assert [(g.after, g.before, g.seconds) for g in gaps] == [(at(10), at(50), 40.0)]
    assert heartbeat_gaps(events, 45, now=at(1000)) == []


def test_a_silent_shard_that_never_withdrew_has_an_open_gap():
    events = [stored(advertised(0), 1), stored(beat(5), 2)]
    gaps = heartbeat_gaps(events, 30, now=at(100))
    assert len(gaps) == 1 and gaps[0].after == at(5) and gaps[0].before is None
    assert heartbeat_gaps(events, 30, now=at(20)) == []


def test_shard_report_lists_advertisements_heartbeat_runs_gaps_and_withdrawal():
    events = [stored(e, i) for i, e in enumerate(
        [advertised(0), beat(5, 10), beat(10, 20), beat(50, 30), advertised(51), beat(55, 40),
         ShardWithdrawn(node_id="node-a", occurred_at=at(60), shard_id=SHARD, reason="shutdown")], start=1)]
    lines = shard_report(SHARD, events, 30, now=at(1000))
    assert lines[0].startswith(f"shard {SHARD}: 7 events")
    kinds = [line.split()[1] for line in lines[1:]]
    assert kinds == ["advertised", "heartbeat", "gap", "heartbeat", "advertised", "heartbeat", "withdrawn"]
    assert "x2" in lines[2] and "tokens_served_total=20" in lines[2]
    assert lines[3].split()[0] == "+50.000s" and "40.0s without heartbeat (> 30s)" in lines[3]
    assert "reason=shutdown" in lines[-1]
