"""The live Projector against a real nats-server: an event its handler cannot apply is kept in rejected_events as
`unapplicable` and counted once, and the events after it are applied, where the batch was retried forever before."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import select
from sqlalchemy.orm import Session

from hearth.events.publish import publish_event
from hearth.events.streams import SHARDS_STREAM, ensure_streams
from hearth.readmodels.runner import Projector
from hearth.readmodels.tables import RejectedEvent, Shard
from hearth.services.broker.connection import connect_nats
from tests.readmodel_helpers import PoisonedProjection, advertised

pytestmark = pytest.mark.integration

WAIT_S = 10.0


def unapplicable_count() -> float:
    return REGISTRY.get_sample_value("hearth_events_rejected_total", {"reason": "unapplicable"}) or 0.0


async def test_an_event_no_handler_can_apply_does_not_hold_the_projector_back(nats_url, tmp_path):
    nc = await connect_nats(nats_url, name="test-projector")
    js = nc.jetstream()
    await ensure_streams(js)
    before = unapplicable_count()
    events = [advertised(0, 3, "a"), advertised(4, 7, "poison"), advertised(0, 3, "b")]
    projection = PoisonedProjection(events[1].event_id, OverflowError("Python int too large for SQLite INTEGER"))
    try:
        async with Projector(tmp_path / "live.db", js, projection=projection) as projector:
            acks = [await publish_event(js, event) for event in events]
            await projector.wait_for_position(SHARDS_STREAM, acks[-1].seq, timeout_s=WAIT_S)
            assert projector.rejected_total == {"unapplicable": 1}
            assert projector.apply_failures_total == 0
            with Session(projector.engine) as session:
                assert sorted(session.scalars(select(Shard.node_id))) == ["a", "b"]
                rejected = session.scalars(select(RejectedEvent)).one()
            assert (rejected.stream_seq, rejected.event_id, rejected.reason) == (
                acks[1].seq, events[1].event_id, "unapplicable")
        assert unapplicable_count() - before == 1
    finally:
        await nc.close()
