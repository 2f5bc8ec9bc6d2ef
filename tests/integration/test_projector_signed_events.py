"""The Projector with a community's verifier against a real nats-server: events published through publish_event
and the EventOutbox with a member key are signed and applied, a forged one is kept in rejected_events and
counted once, and a rebuild with the same verifier gives the same rows."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import select
from sqlalchemy.orm import Session

from hearth.events.models import PipelineCompleted
from hearth.events.outbox import EventOutbox
from hearth.events.publish import publish_event
from hearth.events.signing import EventVerifier
from hearth.events.streams import PIPELINES_STREAM, SHARDS_STREAM, ensure_streams
from hearth.protocol.subjects import shard_control_subject, shard_id_for
from hearth.readmodels.rebuild import diff_databases, rebuild_database
from hearth.readmodels.runner import Projector
from hearth.readmodels.tables import Pipeline, RejectedEvent, Shard
from hearth.services.broker.connection import connect_nats
from tests.readmodel_helpers import MODEL_ID, advertised
from hearth.trust.keys import MemberKey
from hearth.trust.roster import new_member, new_roster

pytestmark = pytest.mark.integration

WAIT_S = 10.0
HOST_KEY, HUB_KEY = MemberKey.generate(), MemberKey.generate()


def own_advertisement(node: str):
    shard_id = shard_id_for(MODEL_ID, 0, 3, node)
    return advertised(0, 3, node, control_subject=shard_control_subject(node, shard_id))


def rejected_count(reason: str) -> float:
    return REGISTRY.get_sample_value("hearth_events_rejected_total", {"reason": reason}) or 0.0


async def test_signed_events_are_applied_and_a_forged_one_is_kept_aside(nats_url, tmp_path):
    roster = new_roster("test").with_member(new_member("host0", "shard", HOST_KEY.public_key)).with_member(
        new_member("hub", "orchestrator", HUB_KEY.public_key))
    verifier = EventVerifier(roster, max_clock_skew_s=30)
    nc = await connect_nats(nats_url, name="test-projector")
    js = nc.jetstream()
    await ensure_streams(js)
    unsigned_before = rejected_count("unsigned")
    live = tmp_path / "live.db"
    try:
        async with Projector(live, js, verifier=verifier) as projector:
            real = own_advertisement("host0")
            await publish_event(js, real, signing_key=HOST_KEY)
            forged = own_advertisement("host1")
            ack = await publish_event(js, forged)
            outbox = EventOutbox(js, max_queued=10, retry_wait_s=0.1, signing_key=HUB_KEY)
            outbox.start()
            await outbox.record(PipelineCompleted(pipeline_id="p-1", prompt_tokens=1, completion_tokens=2,
                                                  duration_ms=3.0, tokens_per_second=4.0, finish_reason="length",
                                                  node_id="hub"))
            await outbox.stop(WAIT_S)
            await projector.wait_for_position(SHARDS_STREAM, ack.seq, timeout_s=WAIT_S)
            await projector.wait_for_position(PIPELINES_STREAM, 1, timeout_s=WAIT_S)
            assert projector.rejected_total == {"unsigned": 1}
            with Session(projector.engine) as session:
                assert [row.shard_id for row in session.scalars(select(Shard))] == [real.shard_id]
                assert session.get(Pipeline, "p-1").status == "completed"
                rejected = session.scalars(select(RejectedEvent)).one()
            assert (rejected.stream, rejected.stream_seq, rejected.event_id, rejected.reason) == (
                SHARDS_STREAM, ack.seq, forged.event_id, "unsigned")
        assert rejected_count("unsigned") - unsigned_before == 1

        with_verifier, without_verifier = tmp_path / "rebuilt.db", tmp_path / "rebuilt-open.db"
        await rebuild_database(js, with_verifier, verifier=verifier)
        await rebuild_database(js, without_verifier)
        assert diff_databases(with_verifier, live) == []
        # Without the roster the forged shard is applied (and counted among the events applied per minute): a
        # rebuild must use the live projectors' verifier.
        assert {d.table for d in diff_databases(without_verifier, live)} == {
            "shards", "rejected_events", "rejected_event_counts", "event_counts"}
    finally:
        await nc.close()
