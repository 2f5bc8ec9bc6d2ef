"""A read model from before applied_events (migration 0017) upgraded: its projector records the ids of the events it
applied before, read back from the stream, so a copy of one published past the duplicate window still counts once."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from datetime import datetime, timezone

import pytest
from alembic import command
from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session, sessionmaker

import hearth.events.streams
import hearth.readmodels.applied_backfill
from hearth.events.models import PipelineCompleted, PipelineConstructed
from hearth.events.publish import publish_event
from hearth.events.streams import PIPELINES_STREAM, seconds_per_day
from hearth.readmodels.applied_backfill import record_stream_ids_applied_before
from hearth.readmodels.db import alembic_config, open_engine
from hearth.readmodels.projection import ReadModelProjection
from hearth.readmodels.retention import retention_policy
from hearth.readmodels.runner import Projector
from hearth.readmodels.tables import AppliedEvent, EventCount, RejectedEvent, HostTokensDaily
from hearth.services.common.config import ReadModelSettings
from tests.event_streams import jetstream_with_streams
from tests.readmodel_helpers import MODEL_ID, WEIGHTS_SHA

pytestmark = pytest.mark.integration

WAIT_S = 10.0
short_duplicate_window_s = 1.0
SHARD = "tiny/llama-test:0-3@host0"


@pytest.fixture
async def js(nats_url, monkeypatch):
    # The stream's 120 s window shrunk, so a re-publish past it takes a second.
    monkeypatch.setattr(hearth.events.streams, "duplicate_window_s", short_duplicate_window_s)
    async with jetstream_with_streams(nats_url, "test-applied-ids-after-upgrade") as jetstream:
        yield jetstream


@pytest.mark.parametrize("retention", [None, retention_policy(ReadModelSettings())], ids=["kept-for-ever", "policy"])
async def test_a_copy_of_an_event_applied_before_the_upgrade_counts_once(js, tmp_path, retention, caplog):
    now = datetime.now(timezone.utc)
    constructed = PipelineConstructed(pipeline_id="p-old", request_id="r-old", model_id=MODEL_ID,
                                      weights_sha256=WEIGHTS_SHA, hops=[SHARD], construct_ms=3.5, node_id="hub",
                                      occurred_at=now)
    completed = PipelineCompleted(pipeline_id="p-old", prompt_tokens=5, completion_tokens=7, duration_ms=3.0,
                                  tokens_per_second=4.0, finish_reason="length", node_id="hub", occurred_at=now)
    live = tmp_path / "live.db"
    async with Projector(live, js, retention=retention) as projector:
        for event in (constructed, completed):
            last = await publish_event(js, event)
        await projector.wait_for_position(PIPELINES_STREAM, last.seq, timeout_s=WAIT_S)
    command.downgrade(alembic_config(live), "0016")  # as a projector from before applied_events left it

    await asyncio.sleep(2 * short_duplicate_window_s)  # the server keeps a re-publish now
    with caplog.at_level(logging.INFO, logger="hearth.readmodels.applied_backfill"):
        async with Projector(live, js, retention=retention) as projector:  # upgrades it, then starts
            copy = await publish_event(js, completed)
            assert not copy.duplicate
            await projector.wait_for_position(PIPELINES_STREAM, copy.seq, timeout_s=WAIT_S)
            assert projector.rejected_total == {"duplicate": 1}
            with Session(projector.engine) as session:
                assert session.scalars(select(HostTokensDaily.tokens)).one() == 12
                assert session.scalars(select(func.sum(EventCount.events)).where(
                    EventCount.type == "pipeline.completed")).one() == 1
                assert [(row.stream_seq, row.reason) for row in session.scalars(select(RejectedEvent))] == [
                    (copy.seq, "duplicate")]
                assert session.scalars(select(func.count()).select_from(AppliedEvent)).one() == 2
    assert f"recorded the ids of 2 applied events of {PIPELINES_STREAM}" in caplog.text


async def test_only_events_a_copy_can_still_be_counted_for_are_read(js, tmp_path, monkeypatch):
    """An event stored longer ago than the ids are kept cannot have a copy counted (it is `too_old`): not read."""
    monkeypatch.setattr(hearth.readmodels.applied_backfill, "applied_ids_margin_s", 0.0)
    kept_s = 1.5
    retention = dataclasses.replace(retention_policy(ReadModelSettings()),
                                    pipelines_retention_days=kept_s / seconds_per_day)
    old = PipelineCompleted(pipeline_id="p-old", prompt_tokens=5, completion_tokens=7, duration_ms=3.0,
                            tokens_per_second=4.0, finish_reason="length", node_id="hub",
                            occurred_at=datetime.now(timezone.utc))
    first = await publish_event(js, old)
    projector = Projector(tmp_path / "rm.db", js, retention=retention)
    await projector.start()  # nothing applied yet: nothing recorded
    await projector.wait_for_position(PIPELINES_STREAM, first.seq, timeout_s=WAIT_S)
    await projector.stop()
    engine = open_engine(tmp_path / "rm.db")
    try:
        with Session(engine) as session:  # as a read model from before applied_events
            session.execute(delete(AppliedEvent))
            session.commit()
        await asyncio.sleep(2 * kept_s)
        # Published just before the read (nothing slow between them), so it is younger than the ids are kept however
        # loaded the machine; the read is up to it, as for a position past it.
        recent = old.model_copy(update={"event_id": "e-recent", "pipeline_id": "p-recent",
                                        "occurred_at": datetime.now(timezone.utc)})
        last = await publish_event(js, recent)
        recorded = await record_stream_ids_applied_before(js, sessionmaker(engine),
                                                          ReadModelProjection(retention=retention), PIPELINES_STREAM,
                                                          last.seq)
    finally:
        engine.dispose()
    assert recorded == 1  # the recent event's; the old one was not read
