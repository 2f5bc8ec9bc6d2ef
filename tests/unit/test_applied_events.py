"""Each event counted once by its id: a copy stored again past the broker's duplicate window is rejected `duplicate`
(in the same batch or a later one), one older than the ids are kept is rejected `too_old`, and the ids a pruning
removed are exactly those whose copies would be too old."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from sqlalchemy import text
from sqlalchemy.orm import sessionmaker

from hearth.events.models import PipelineCompleted
from hearth.events.streams import PIPELINES_STREAM, seconds_per_day
from hearth.readmodels.projection import ReadModelProjection
from hearth.readmodels.retention import applied_ids_margin_s, history_kept_s, prune_all, retention_policy
from hearth.services.common.config import ReadModelSettings
from hearth.services.replay import verify
from tests.readmodel_helpers import LogBuilder, advertised, apply_all, at, constructed, heartbeat, migrated_engine
from tests.reputation_events import verified

POLICY = retention_policy(ReadModelSettings())
KEPT_S = POLICY.pipelines_retention_days * seconds_per_day


def completed(pipeline_id: str, *, t: float) -> PipelineCompleted:
    return PipelineCompleted(pipeline_id=pipeline_id, prompt_tokens=5, completion_tokens=7, duration_ms=3.0,
                             tokens_per_second=4.0, finish_reason="length", node_id="hub", occurred_at=at(t))


def stored_later(log: LogBuilder, event, delay_s: float):
    """`event` as the stream stores it `delay_s` after it occurred (a late retry, a re-publish)."""
    return dataclasses.replace(log.stored(event), time=event.occurred_at + timedelta(seconds=delay_s))


def scalar(engine, sql: str):
    with engine.connect() as connection:
        return connection.execute(text(sql)).scalar()


def rejected(engine) -> list[tuple]:
    with engine.connect() as connection:
        return sorted(connection.execute(text("SELECT stream_seq, event_id, reason FROM rejected_events")))


def test_a_copy_stored_again_is_counted_once_in_one_batch_or_the_next(tmp_path):
    engine = migrated_engine(tmp_path / "rm.db")
    shard = advertised(0, 3, "host0")
    done, checks = completed("p-1", t=10.0), verified("p-1", {shard.shard_id: (2, 9)}, t=11.0)
    log = LogBuilder()
    first = [log.stored(event) for event in (constructed("p-1", [shard.shard_id]), done, checks)]
    copies = [stored_later(log, event, 300.0) for event in (done, checks, done)]
    assert apply_all(engine, first + copies[:1]) == 4  # a copy in the batch that applied the event
    assert apply_all(engine, copies[1:]) == 2  # and copies in a later transaction
    assert scalar(engine, "SELECT tokens FROM host_tokens_daily") == 12
    assert scalar(engine, "SELECT checks || '/' || verified_positions FROM shard_reputation") == "2/9"
    assert scalar(engine, "SELECT SUM(events) FROM event_counts WHERE type = 'pipeline.completed'") == 1
    assert rejected(engine) == [(4, done.event_id, "duplicate"), (5, checks.event_id, "duplicate"),
                                (6, done.event_id, "duplicate")]
    assert scalar(engine, "SELECT SUM(events) FROM rejected_event_counts WHERE reason = 'duplicate'") == 3


def test_a_rejected_event_does_not_hold_its_id_against_the_real_one(tmp_path):
    """A forged copy stored first (rejected by the roster) must not make the real event a duplicate."""

    class RejectsTheFirst:
        def rejection(self, event, *, received_at, stored_data=b"", position=None, removal_logged=False,
                      steward_succession=None, member_succession=None, member_addition=None):
            return "bad_signature" if position.seq == 1 else None

    engine = migrated_engine(tmp_path / "rm.db")
    done = completed("p-1", t=10.0)
    log = LogBuilder()
    apply_all(engine, [log.stored(done), log.stored(done)], ReadModelProjection(verifier=RejectsTheFirst()))
    assert scalar(engine, "SELECT status FROM pipelines") == "completed"
    assert rejected(engine) == [(1, done.event_id, "bad_signature")]


def test_an_event_older_than_its_id_is_kept_is_too_old(tmp_path):
    engine = migrated_engine(tmp_path / "rm.db")
    log = LogBuilder()
    late, just_in_time = completed("p-late", t=0.0), completed("p-kept", t=0.0)
    projection = ReadModelProjection(retention=POLICY)
    apply_all(engine, [stored_later(log, late, KEPT_S + 1), stored_later(log, just_in_time, KEPT_S)], projection)
    assert rejected(engine) == [(1, late.event_id, "too_old")]
    assert scalar(engine, "SELECT pipeline_id FROM pipelines") == "p-kept"
    # Without a retention policy nothing is pruned, so no event is too old.
    open_engine = migrated_engine(tmp_path / "open.db")
    apply_all(open_engine, [stored_later(LogBuilder(), late, 10 * KEPT_S)])
    assert rejected(open_engine) == []


def test_an_id_is_pruned_only_once_a_copy_would_be_too_old(tmp_path):
    assert history_kept_s(POLICY, PIPELINES_STREAM) == KEPT_S
    engine = migrated_engine(tmp_path / "rm.db")
    log = LogBuilder()
    projection = ReadModelProjection(retention=POLICY)
    done = completed("p-1", t=0.0)
    apply_all(engine, [log.stored(done), log.stored(completed("p-2", t=KEPT_S + 60))], projection)
    prune_all(sessionmaker(engine), POLICY, projection.name)
    # Kept a margin past the window (a broker clock stepped back): a copy now is both too old and known.
    assert scalar(engine, "SELECT COUNT(*) FROM applied_events") == 2
    apply_all(engine, [log.stored(completed("p-3", t=KEPT_S + applied_ids_margin_s + 60))], projection)
    prune_all(sessionmaker(engine), POLICY, projection.name)
    assert scalar(engine, "SELECT COUNT(*) FROM applied_events") == 2  # p-1's id went with the stream's history
    apply_all(engine, [stored_later(log, done, KEPT_S + applied_ids_margin_s + 60)], projection)
    assert rejected(engine) == [(4, done.event_id, "too_old")]


def test_verify_tells_copies_and_too_old_events_as_a_projection_does(monkeypatch):
    monkeypatch.setattr(verify, "forget_every_events", 2)  # forget often, to show it forgets only what aged out
    log = LogBuilder()
    passed = verify.PassedEvents(KEPT_S)
    old, recent = completed("p-old", t=0.0), completed("p-new", t=KEPT_S)
    assert passed.repeat(log.stored(old)) is None
    assert passed.repeat(log.stored(recent)) is None  # the second: forgets what aged past the kept window
    assert passed.repeat(stored_later(log, recent, 60.0)) == "duplicate"
    assert passed.repeat(stored_later(log, old, KEPT_S + 60)) == "too_old"
    assert verify.PassedEvents(None).repeat(stored_later(log, old, 10 * KEPT_S)) is None


def test_heartbeats_keep_no_id_and_a_copy_changes_no_figure(tmp_path):
    """A heartbeat states a shard's latest figures: its copy changes nothing, so no id is kept for it (they would be
    most of the table: one every few seconds per shard)."""
    engine = migrated_engine(tmp_path / "rm.db")
    shard = advertised(0, 3, "host0")
    beat = heartbeat(shard.shard_id, t=10.0, active_streams=2)
    log = LogBuilder()
    apply_all(engine, [log.stored(shard), log.stored(beat), stored_later(log, beat, 300.0)])
    assert scalar(engine, "SELECT COUNT(*) FROM applied_events") == 1  # the advert's alone
    last_seen = int(at(10.0).timestamp())
    assert scalar(engine, "SELECT active_streams || '@' || last_seen FROM shard_health") == f"2@{last_seen}"
    assert rejected(engine) == []
    passed = verify.PassedEvents(KEPT_S)  # and `hearth-replay verify` takes the copy as the projection does
    assert [passed.repeat(log.stored(beat)), passed.repeat(stored_later(log, beat, 300.0))] == [None, None]


def test_a_heartbeats_copy_adds_nothing_to_the_per_minute_count(tmp_path):
    """event_counts counts a heartbeat its shard's state took: not a copy of the latest one, nor a copy of an older one
    (both change nothing), while a second heartbeat in the same second, its own event, counts."""
    engine = migrated_engine(tmp_path / "rm.db")
    shard = advertised(0, 3, "host0")
    first, same_second, later = (heartbeat(shard.shard_id, t=t, active_streams=n)
                                 for n, t in ((1, 10.0), (2, 10.5), (3, 12.0)))
    log = LogBuilder()
    apply_all(engine, [log.stored(shard), log.stored(first), log.stored(same_second)])
    apply_all(engine, [stored_later(log, same_second, 300.0), log.stored(later), stored_later(log, first, 400.0)])
    assert scalar(engine, "SELECT SUM(events) FROM event_counts WHERE type = 'shard.heartbeat'") == 3
    assert scalar(engine, "SELECT active_streams FROM shard_health") == 3
    assert rejected(engine) == []
