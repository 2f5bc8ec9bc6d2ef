"""The ids a read model from before applied_events (migration 0017) records on its upgrade are those of the events a
projection applies now, with the steward keys the stream's log names: before, the backfill checked against the roster
alone, so what the steward's new key signed got no id (a copy stored later counted again), even when the rotation
that named the key was stored before the part of the stream the backfill reads."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

import hearth.readmodels.applied_backfill as applied_backfill
from hearth.events.consume import StoredEvent
from hearth.events.signing import EventVerifier
from hearth.events.streams import SHARDS_STREAM
from hearth.readmodels.applied_events import keeps_id
from hearth.readmodels.projection import ReadModelProjection
from hearth.readmodels.retention import retention_policy
from hearth.readmodels.tables import AppliedEvent
from hearth.services.common.config import ReadModelSettings
from tests.readmodel_helpers import at, migrated_engine
from tests.unit.test_steward_key_from_the_log import EXPECTED_REJECTIONS, SKEW_S, old_roster, steward_log


def fake_read_stream(log: list[StoredEvent]):
    """read_stream over `log`, as the broker serves it: from a sequence or a storage time, to a sequence, filtered."""
    async def read_stream(js, stream, *, from_seq=1, to_seq=None, subject_filter=None, from_time=None, **_):
        filters = [subject_filter] if isinstance(subject_filter, str) else subject_filter
        for message in log:
            if message.stream != stream or message.seq < from_seq or (to_seq is not None and message.seq > to_seq):
                continue
            if (from_time is not None and message.time < from_time) or (filters and message.subject not in filters):
                continue
            yield message
    return read_stream


def recorded_ids(tmp_path, monkeypatch, log: list[StoredEvent], retention=None) -> set[str]:
    monkeypatch.setattr(applied_backfill, "read_stream", fake_read_stream(log))
    engine = migrated_engine(tmp_path / "rm.db")
    try:
        projection = ReadModelProjection(verifier=EventVerifier(old_roster(), max_clock_skew_s=SKEW_S),
                                         retention=retention)
        asyncio.run(applied_backfill.record_stream_ids_applied_before(
            None, sessionmaker(engine), projection, SHARDS_STREAM, log[-1].seq))
        with Session(engine) as session:
            return set(session.scalars(select(AppliedEvent.event_id)))
    finally:
        engine.dispose()


def applied_ids(log: list[StoredEvent], since_seq: int = 1) -> set[str]:
    rejected = {seq for seq, _ in EXPECTED_REJECTIONS}
    return {message.event.event_id for message in log
            if message.seq >= since_seq and message.seq not in rejected and keeps_id(message)}


def test_the_ids_of_what_the_new_steward_key_signed_are_recorded(tmp_path, monkeypatch):
    log = steward_log()
    assert recorded_ids(tmp_path, monkeypatch, log) == applied_ids(log)


def test_a_rotation_stored_before_the_part_read_still_names_the_steward_key(tmp_path, monkeypatch):
    """The ids are read from a time on (what a copy can still be counted for); the rotation at t=20 is older."""
    log = steward_log()
    retention = retention_policy(ReadModelSettings())
    window_start = at(25)  # between the rotation (seq 3, t=20) and the new key's removal (seq 6, t=30)
    kept_s = (datetime.now(timezone.utc) - window_start).total_seconds() - applied_backfill.applied_ids_margin_s
    monkeypatch.setattr(applied_backfill, "history_kept_s", lambda policy, stream: kept_s)
    assert recorded_ids(tmp_path, monkeypatch, log, retention) == applied_ids(log, since_seq=5)
