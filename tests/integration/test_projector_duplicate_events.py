"""The projector against a real nats-server whose duplicate window has passed: a signed event published a second
time is a second stream message, and the read models (live and rebuilt) still count it once, the copy rejected as
`duplicate`, and `hearth-replay verify` reports each copy."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

import hearth.events.streams
from hearth.events.models import IntegrityShardsVerified, PipelineCompleted, PipelineConstructed, ShardVerification
from hearth.events.publish import publish_event
from hearth.events.signing import EventVerifier, sign_event
from hearth.events.streams import PIPELINES_STREAM
from hearth.readmodels.db import open_engine
from hearth.readmodels.rebuild import diff_databases, rebuild_database
from hearth.readmodels.runner import Projector
from hearth.readmodels.tables import HostTokensDaily, RejectedEvent, ShardReputation
from hearth.services.replay.verify import verify_streams
from hearth.trust.keys import MemberKey
from hearth.trust.roster import new_member, new_roster
from tests.readmodel_helpers import MODEL_ID, WEIGHTS_SHA
from tests.event_streams import jetstream_with_streams

pytestmark = pytest.mark.integration

WAIT_S = 10.0
short_duplicate_window_s = 1.0
HUB_KEY = MemberKey.generate()
SHARD = "tiny/llama-test:0-3@host0"


@pytest.fixture
async def js(nats_url, monkeypatch):
    # The stream's 120 s window shrunk, so a re-publish past it takes a second.
    monkeypatch.setattr(hearth.events.streams, "duplicate_window_s", short_duplicate_window_s)
    async with jetstream_with_streams(nats_url, "test-projector-duplicates") as jetstream:
        yield jetstream


def call_events(now: datetime) -> list:
    """A call on one shard, completed and verified, signed by the orchestrator that ran it."""
    events = [
        PipelineConstructed(pipeline_id="p-dup", request_id="r-dup", model_id=MODEL_ID, weights_sha256=WEIGHTS_SHA,
                            hops=[SHARD], construct_ms=3.5, node_id="hub", occurred_at=now),
        PipelineCompleted(pipeline_id="p-dup", prompt_tokens=5, completion_tokens=7, duration_ms=3.0,
                          tokens_per_second=4.0, finish_reason="length", node_id="hub", occurred_at=now),
        IntegrityShardsVerified(pipeline_id="p-dup", node_id="hub", occurred_at=now,
                                shards=[ShardVerification(shard_id=SHARD, checks=2, verified_positions=9)]),
    ]
    return [sign_event(event, HUB_KEY) for event in events]


async def test_an_event_published_again_past_the_duplicate_window_is_counted_once(js, tmp_path):
    verifier = EventVerifier(new_roster("test").with_member(new_member("hub", "orchestrator", HUB_KEY.public_key)),
                             max_clock_skew_s=30)
    constructed, completed, verified = call_events(datetime.now(timezone.utc))
    live = tmp_path / "live.db"
    async with Projector(live, js, verifier=verifier) as projector:
        for event in (constructed, completed, verified):
            await publish_event(js, event)
        await asyncio.sleep(2 * short_duplicate_window_s)  # the server keeps a re-publish now
        for event in (completed, verified):  # a member re-publishing what it captured, or a late retry
            last = await publish_event(js, event)
        assert last.seq == 5 and not last.duplicate
        await projector.wait_for_position(PIPELINES_STREAM, last.seq, timeout_s=WAIT_S)
        assert projector.rejected_total == {"duplicate": 2}
        with Session(projector.engine) as session:
            assert session.scalars(select(HostTokensDaily.tokens)).one() == 12
            reputation = session.get(ShardReputation, SHARD)
            assert (reputation.checks, reputation.verified_positions) == (2, 9)
            assert sorted((row.stream_seq, row.event_id, row.reason)
                          for row in session.scalars(select(RejectedEvent))) == [
                (4, completed.event_id, "duplicate"), (5, verified.event_id, "duplicate")]

    rebuilt = tmp_path / "rebuilt.db"
    await rebuild_database(js, rebuilt, verifier=verifier)
    assert diff_databases(rebuilt, live) == []
    engine = open_engine(rebuilt)
    try:
        with Session(engine) as session:  # not vacuous: the rebuild counted the tokens once too
            assert session.scalars(select(HostTokensDaily.tokens)).one() == 12
    finally:
        engine.dispose()

    report = await verify_streams(js, verifier, [PIPELINES_STREAM])
    assert [(bad.seq, bad.event_id, bad.reason) for bad in report.bad] == [
        (4, completed.event_id, "duplicate"), (5, verified.event_id, "duplicate")]
