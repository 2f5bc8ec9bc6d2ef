"""Who created a consumer, as the broker's API audit advisories say (hearth/services/broker/consumer_sweep.py):
only successful creations by members are noted, a consumer is known only under the creation time the broker
answered, and what is noted stays bounded."""

from __future__ import annotations

import json

import pytest

from hearth.services.broker.consumer_sweep import ConsumerCreators, unwanted
from hearth.trust.community import Community


@pytest.fixture(scope="module")
def roster(tmp_path_factory):
    community = Community.init(tmp_path_factory.mktemp("community") / "c", "creators-test")
    community.add("eve", "auditor")
    community.add("orch", "orchestrator")
    return community.roster()


def audit(roster, member: str, *, name="c1", stream="HEARTH_SHARDS", created="2026-12-05T03:19:56.5Z",
          subject=None, error=False) -> dict:
    answer = {"error": {"code": 400}} if error else {"stream_name": stream, "name": name, "created": created}
    key = next(m.public_key for m in roster.members if m.name == member) if member else "UNOTAMEMBER"
    return {"type": "io.nats.jetstream.advisory.v1.api_audit", "client": {"user": key},
            "subject": subject or f"$JS.API.CONSUMER.CREATE.{stream}.{name}", "response": json.dumps(answer)}


def test_only_a_members_successful_creation_is_noted_and_only_under_its_creation_time(roster):
    creators = ConsumerCreators()
    assert not creators.record(audit(roster, "eve", subject="$JS.API.STREAM.INFO.HEARTH_SHARDS"), lambda: roster)
    assert not creators.record(audit(roster, "eve", error=True), lambda: roster)
    assert not creators.record(audit(roster, None), lambda: roster)
    assert not creators.record({"subject": "$JS.API.CONSUMER.CREATE.S.c", "response": "{not json"}, lambda: roster)
    assert not creators.record("not an advisory", lambda: roster)
    assert len(creators) == 0
    assert creators.record(audit(roster, "eve"), lambda: roster)
    assert creators.record(audit(roster, "orch", name="d1", subject="$JS.API.CONSUMER.DURABLE.CREATE.HEARTH_SHARDS.d1"),
                           lambda: roster)
    assert creators.creator("HEARTH_SHARDS", {"name": "c1", "created": "2026-12-05T03:19:56.5Z"}) == "eve"
    assert creators.creator("HEARTH_SHARDS", {"name": "d1", "created": "2026-12-05T03:19:56.5Z"}) == "orch"
    # The same name created again later (by someone the sweeper did not hear) is not eve's.
    assert creators.creator("HEARTH_SHARDS", {"name": "c1", "created": "2026-12-05T04:00:00Z"}) is None
    assert creators.creator("HEARTH_PIPELINES", {"name": "c1", "created": "2026-12-05T03:19:56.5Z"}) is None


def test_what_a_listing_no_longer_shows_is_forgotten_and_the_oldest_go_past_the_limit(roster):
    creators = ConsumerCreators(limit=3)
    for index in range(5):
        creators.record(audit(roster, "eve", name=f"c{index}"), lambda: roster)
    assert len(creators) == 3
    assert creators.creator("HEARTH_SHARDS", {"name": "c1", "created": "2026-12-05T03:19:56.5Z"}) is None
    creators.forget_absent("HEARTH_SHARDS", ["c4"], listed_since=0.0)  # a listing older than every note: kept
    assert len(creators) == 3
    creators.forget_absent("HEARTH_SHARDS", ["c4"], listed_since=float("inf"))
    assert len(creators) == 1
    assert creators.creator("HEARTH_SHARDS", {"name": "c4", "created": "2026-12-05T03:19:56.5Z"}) == "eve"


def test_a_known_creator_must_push_into_its_own_inbox_and_counts_its_own_places():
    readers = frozenset({"eve", "orch"})
    consumers = [{"name": name, "config": {"deliver_subject": f"_INBOX.{inbox}.x", "inactive_threshold": 10**9}}
                 for name, inbox in (("eve-into-orch", "orch"), ("orch-own", "orch"), ("unknown-into-orch", "orch"))]
    made_by = {"eve-into-orch": "eve", "orch-own": "orch"}
    verdicts = unwanted(consumers, readers, 60.0, lambda entry: made_by.get(entry["name"]))
    assert list(verdicts) == ["eve-into-orch"] and "eve made it deliver" in verdicts["eve-into-orch"]
    # Without the audit the inbox's owner stands in: each may stay.
    assert unwanted(consumers, readers, 60.0) == {}
