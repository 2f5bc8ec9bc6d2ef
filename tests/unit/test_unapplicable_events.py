"""An event no handler can apply is recorded as rejected (`unapplicable`) and the projection goes on past it, the same
rows whatever the batches; a failure of the database is no message's and is not recorded (readmodels.unapplicable)."""

from __future__ import annotations

import sqlite3

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from hearth.events.streams import SHARDS_STREAM
from hearth.readmodels.positions import load_positions
from hearth.readmodels.projection import Rejection
from hearth.readmodels.tables import RejectedEvent, Shard
from hearth.readmodels.unapplicable import UNAPPLICABLE, apply_rejecting_the_unapplicable
from tests.readmodel_helpers import (
    LogBuilder,
    PoisonedProjection,
    advertised,
    dump_rows,
    heartbeat,
    migrated_engine,
)


def _log_with_a_poison():
    log = LogBuilder()
    first, second = advertised(0, 3, "a"), advertised(4, 7, "b")
    poison = heartbeat(first.shard_id, tokens=5)
    return [log.stored(event) for event in (first, poison, second, heartbeat(second.shard_id, tokens=7))], poison


def _apply(engine, projection, messages, rejections: list[Rejection]) -> list[int]:
    factory = sessionmaker(engine)

    def transaction(batch, reject_as):
        with factory() as session, session.begin():
            return [projection.apply_many(session, batch, rejections=rejections, reject_as=reject_as)]

    return apply_rejecting_the_unapplicable(transaction, messages, projection=projection.name)


@pytest.mark.parametrize("batch_size", [1, 2, 4])
def test_the_event_no_handler_can_apply_is_rejected_and_the_rest_applied(tmp_path, batch_size):
    messages, poison = _log_with_a_poison()
    engine = migrated_engine(tmp_path / "rm.db")
    projection = PoisonedProjection(poison.event_id, ValueError("no column takes this"))
    rejections: list[Rejection] = []
    applied = []
    for start in range(0, len(messages), batch_size):
        applied += _apply(engine, projection, messages[start:start + batch_size], rejections)
    assert sum(applied) == len(messages)
    assert rejections == [Rejection(SHARDS_STREAM, 2, "shard.heartbeat", UNAPPLICABLE)]
    with Session(engine) as session:
        assert load_positions(session) == {SHARDS_STREAM: 4}
        assert sorted(session.scalars(select(Shard.node_id))) == ["a", "b"]
        rejected = session.scalars(select(RejectedEvent)).one()
        assert (rejected.stream_seq, rejected.event_id, rejected.reason) == (2, poison.event_id, "unapplicable")
    # Applied again, nothing changes: the rejection moved the position past the event for good.
    raised = projection.raised
    assert _apply(engine, projection, messages, rejections) == [0]
    assert projection.raised == raised
    engine.dispose()


def test_rows_are_the_same_whatever_the_batches(tmp_path):
    messages, poison = _log_with_a_poison()
    dumps = []
    for batch_size in (1, 3, 4):
        engine = migrated_engine(tmp_path / f"rm-{batch_size}.db")
        projection = PoisonedProjection(poison.event_id, KeyError("shard"))
        for start in range(0, len(messages), batch_size):
            _apply(engine, projection, messages[start:start + batch_size], [])
        dumps.append(dump_rows(engine))
        engine.dispose()
    assert dumps[0] == dumps[1] == dumps[2]


@pytest.mark.parametrize("error", [sqlite3.OperationalError("database is locked"), MemoryError()],
                         ids=["database-locked", "out-of-memory"])
def test_a_failure_that_is_no_messages_fault_propagates_and_rejects_nothing(tmp_path, error):
    messages, poison = _log_with_a_poison()
    engine = migrated_engine(tmp_path / "rm.db")
    rejections: list[Rejection] = []
    with pytest.raises(type(error)):
        _apply(engine, PoisonedProjection(poison.event_id, error), messages, rejections)
    assert rejections == []
    assert all(not rows for rows in dump_rows(engine).values())
    engine.dispose()
