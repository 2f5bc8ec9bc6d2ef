"""Members of one community on different hearth versions, on a real broker: what a newer hearth writes, published by
hand with the member's own key on its own subjects, and what this hearth's projector, rebuild and audit make of it;
and a newer orchestrator's `open` to this hearth's shard."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from hearth.events import consume
from hearth.events.envelope import new_event_id, utc_now
from hearth.events.newer_hearth import NewerHearthNotices
from hearth.events.signing import EventVerifier, canonical_json
from hearth.events.streams import ALL_STREAMS, SHARDS_STREAM
from hearth.protocol.control import ControlReply, OpenHop
from hearth.protocol.mesh_protocol import MESH_PROTOCOL, mesh_protocol_refusal
from hearth.protocol.subjects import EVENTS_PREFIX, shard_control_subject, shard_key
from hearth.readmodels.db import open_engine, upgrade_database
from hearth.readmodels.rebuild import diff_databases, rebuild_database
from hearth.readmodels.tables import RejectedEvent, Shard, ShardHealth
from hearth.services.broker.connection import connect_nats
from hearth.services.common.config import NatsSettings
from hearth.services.replay.verify import verify_streams
from hearth.trust.keys import MemberKey
from tests.community_log import apply_new_messages, as_auditor, community_on_a_broker
from tests.integration.tiny_shard_server import CONTEXT, tiny_shard_server
from tests.readmodel_helpers import advertised

pytestmark = pytest.mark.integration
ATTIC_SHARD = advertised(0, 3, "attic").shard_id
reply_timeout_s = 5.0


def attic_wrote(kind: str, **fields) -> tuple[str, bytes]:
    """(subject, body) of a shard event of `kind` as attic's hearth, whatever its version, publishes it."""
    body = {"event_id": new_event_id(), "version": 1, "occurred_at": utc_now().isoformat(), "node_id": "attic",
            "type": kind, "shard_id": ATTIC_SHARD, **fields}
    return f"{EVENTS_PREFIX}.shard.attic.{shard_key(ATTIC_SHARD)}.{kind.partition('.')[2]}", body


async def publish_signed(url: str, seed_file, written: list[tuple[str, dict]], *, forged: tuple[int, ...] = ()) -> None:
    """Publish each of `written` as attic, signed; those at the indices `forged` changed after signing."""
    key = MemberKey.load(seed_file)
    connection = await connect_nats(url, name="test-attic", settings=NatsSettings(url=url, creds_file=seed_file))
    try:
        js = connection.jetstream()
        for index, (subject, body) in enumerate(written):
            body = {**body, "signer": key.public_key}
            body["signature"] = key.sign_b64(canonical_json(body))
            if index in forged:
                body["occurred_at"] = utc_now().isoformat()
            await js.publish(subject, json.dumps(body).encode(), headers={"Nats-Msg-Id": body["event_id"]})
    finally:
        await connection.close()


def test_a_newer_hearths_events_are_kept_as_rejected_and_what_follows_is_applied(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(consume, "newer_hearth_notices", NewerHearthNotices())  # nothing told yet in this process
    with community_on_a_broker(tmp_path, (("attic", "shard"), ("eve", "auditor"))) as (community, server):
        advert = json.loads(advertised(0, 3, "attic", control_subject=shard_control_subject(
            "attic", ATTIC_SHARD)).model_dump_json())
        heartbeat = dict(queue_depth=0, active_streams=0, p95_latency_ms=1.0, tokens_served_total=7)
        asyncio.run(publish_signed(server.url, community.directory / "keys" / "attic.nk", [
            # A field added since: read, the signature checked over the body as stored.
            attic_wrote("shard.advertised", **{**advert, "gpu_kind": "a field a newer hearth added"}),
            attic_wrote("shard.relocated", to="garage"),  # a type added since
            attic_wrote("shard.relocated", to="garage"),
            attic_wrote("shard.heartbeat", **{**heartbeat, "version": 2}),  # a breaking change since
            attic_wrote("shard.heartbeat", **heartbeat),
            attic_wrote("shard.relocated", to="garage"),  # changed after it was signed: no newer hearth's event
        ], forged=(5,)))
        live = tmp_path / "live.sqlite"
        upgrade_database(live)
        verifier = EventVerifier(community.roster(), max_clock_skew_s=30)
        caplog.set_level(logging.WARNING)
        apply_new_messages(community, server.url, live, verifier)

        engine = open_engine(live)
        with Session(engine) as session:
            assert [row.shard_id for row in session.scalars(select(Shard))] == [ATTIC_SHARD]
            assert session.get(ShardHealth, ATTIC_SHARD).tokens_served_total == 7
            kept = [(row.stream_seq, row.type, row.reason, row.node_id)
                    for row in session.scalars(select(RejectedEvent).order_by(RejectedEvent.stream_seq))]
        engine.dispose()
        assert kept == [(seq, "shard.relocated", "newer_hearth", "attic") for seq in (2, 3)] + [
            (4, "shard.heartbeat version 2", "newer_hearth", "attic"), (6, "shard.relocated", "bad_signature", "attic")]
        warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
        assert len(warnings) == 3, warnings  # one per type and version, however many of its events; the forged one
        assert "'shard.relocated' is not one this hearth knows" in warnings[0]
        assert "shard.heartbeat version 2 is newer than this hearth reads (up to 1)" in warnings[1]
        assert "shard.relocated" in warnings[2] and "bad_signature" in warnings[2]

        # A rebuild by this hearth keeps them the same way; the audit names each one as the read model does.
        fresh = tmp_path / "fresh.sqlite"
        asyncio.run(as_auditor(community, server.url, lambda js: rebuild_database(js, fresh, verifier=verifier)))
        assert diff_databases(fresh, live) == []
        report = asyncio.run(as_auditor(community, server.url, lambda js: verify_streams(js, verifier, ALL_STREAMS)))
        assert [(bad.stream, bad.seq, bad.reason, bad.event_type) for bad in report.bad] == [
            (SHARDS_STREAM, seq, "newer_hearth", kind) for seq, kind in
            ((2, "shard.relocated"), (3, "shard.relocated"), (4, "shard.heartbeat version 2"))] + [
            (SHARDS_STREAM, 6, "bad_signature", "shard.relocated")]


@pytest.mark.parametrize("protocol", [MESH_PROTOCOL + 1, None])
async def test_an_open_of_another_version_naming_a_field_this_shard_does_not_know_is_refused_naming_both(
        nats_server, protocol):
    """A newer orchestrator's open (a field added since) and an older one's (without `protocol`) are refused as what
    they are, at once, not as a field this shard cannot read."""
    async with tiny_shard_server(nats_server.url) as shard:
        body = {**OpenHop(pipeline_id="pipeline-a", session_id="s", hop=0, hop_count=1, model_id="tiny",
                          weights_sha256="0" * 64, layer_lo=0, layer_hi=1, max_session_tokens=CONTEXT
                          ).model_dump(mode="json", exclude={"protocol"}),
                "draft_tokens": 4, **({} if protocol is None else {"protocol": protocol})}
        message = await shard.client.request(shard.subject, json.dumps(body).encode(), timeout=reply_timeout_s)
        reply = ControlReply.model_validate_json(message.data)
        assert (reply.ok, reply.code, reply.message) == (
            False, "bad_request", mesh_protocol_refusal(protocol, "the orchestrator"))
