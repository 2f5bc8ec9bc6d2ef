"""Signed events: canonical bytes, signing, the acceptance rule of hearth/events/signing.py, and the projection keeping
what it rejects in rejected_events while its position still advances."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from hearth.events.consume import StoredEvent
from hearth.events.models import (
    PipelineCompleted,
    ShardWithdrawn,
    decode_event,
    encode_event,
)
from hearth.events.signing import (
    REJECTION_REASONS,
    EventVerifier,
    RosterFile,
    StreamPosition,
    canonical_bytes,
    canonical_json,
    sign_event,
)
from hearth.events.streams import PIPELINES_STREAM, SHARDS_STREAM
from hearth.protocol.subjects import event_subject, shard_control_subject, shard_id_for
from hearth.readmodels.positions import load_positions
from hearth.readmodels.projection import ReadModelProjection, Rejection
from hearth.readmodels.tables import RejectedEvent, Shard
from tests.readmodel_helpers import MODEL_ID, T0, advertised, at, migrated_engine
from hearth.trust.keys import MemberKey
from hearth.trust.roster import Roster, new_member, new_roster

SKEW_S = 30.0
KEYS = {name: MemberKey.generate() for name in ("host0", "host1", "hub", "alice", "outsider")}
ROLES = {"host0": "shard", "host1": "shard", "hub": "orchestrator", "alice": "client"}


def community_roster(names=("host0", "host1", "hub", "alice")) -> Roster:
    roster = new_roster("test")
    for name in names:
        roster = roster.with_member(new_member(name, ROLES[name], KEYS[name].public_key))
    return roster


@pytest.fixture
def verifier() -> EventVerifier:
    return EventVerifier(community_roster(), max_clock_skew_s=SKEW_S)


def own_advertisement(node: str, *, t: float = 0.0, **overrides):
    shard_id = shard_id_for(MODEL_ID, 0, 3, node)
    fields = dict(control_subject=shard_control_subject(node, shard_id), t=t)
    fields.update(overrides)
    return advertised(0, 3, node, **fields)


def completed(node: str = "hub", *, t: float = 0.0) -> PipelineCompleted:
    return PipelineCompleted(pipeline_id="p-1", prompt_tokens=3, completion_tokens=4, duration_ms=5.0,
                             tokens_per_second=800.0, finish_reason="length", node_id=node, occurred_at=at(t))


def stored(event, seq: int = 1, *, stored_at=None) -> StoredEvent:
    """As a projector reads it: the body exactly as published, stored at `stored_at` (default occurred_at)."""
    return StoredEvent(stream=SHARDS_STREAM if event.type.startswith("shard.") else "HEARTH_PIPELINES", seq=seq,
                       subject=event_subject(event), time=stored_at or event.occurred_at, headers={},
                       event=event, data=encode_event(event))


def verdict(verifier: EventVerifier, event, *, stored_at=None):
    message = stored(event, stored_at=stored_at)
    return verifier.rejection(message.event, received_at=message.time, stored_data=message.data)


# ---- canonical bytes and signatures -------------------------------------------------------------------------


def test_canonical_bytes_are_sorted_compact_json_without_the_signature():
    signed = sign_event(completed(), KEYS["hub"])
    document = json.loads(canonical_bytes(signed))
    assert "signature" not in document and document["signer"] == KEYS["hub"].public_key
    assert canonical_bytes(signed) == json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
    # The same bytes whatever the order of the fields and whatever the signature says.
    shuffled = dict(reversed(list(json.loads(encode_event(signed)).items())))
    assert canonical_json(shuffled) == canonical_bytes(signed)
    assert canonical_json({**shuffled, "signature": "other"}) == canonical_bytes(signed)


def test_a_signed_event_survives_the_wire_and_verifies(verifier):
    signed = sign_event(own_advertisement("host0"), KEYS["host0"])
    assert signed.signer == KEYS["host0"].public_key and len(signed.signature) == 88
    decoded = decode_event(encode_event(signed))
    assert decoded == signed
    assert verdict(verifier, signed) is None
    assert verifier.rejection(decoded, received_at=decoded.occurred_at) is None  # without the stored body too


def test_unsigned_events_still_decode_and_are_the_only_ones_an_open_mesh_sees():
    legacy = {"event_id": "e1", "type": "shard.withdrawn", "version": 1, "occurred_at": T0.isoformat(),
              "node_id": "host0", "shard_id": shard_id_for(MODEL_ID, 0, 3, "host0"), "reason": "shutdown"}
    event = decode_event(json.dumps(legacy))
    assert (event.signer, event.signature) == (None, None)
    assert decode_event(encode_event(event)) == event


def test_a_field_a_newer_emitter_added_is_covered_by_the_signature(verifier):
    """Verified over the stored body: a field this code does not know still counts, and cannot be slipped in."""
    event = own_advertisement("host0")
    body = {**json.loads(encode_event(event)), "signer": KEYS["host0"].public_key, "gpu": "a newer field"}
    body["signature"] = KEYS["host0"].sign_b64(canonical_json(body))
    data = json.dumps(body).encode()
    decoded = decode_event(data)
    assert verifier.rejection(decoded, received_at=decoded.occurred_at, stored_data=data) is None
    slipped = json.dumps({**body, "gpu": "something else"}).encode()
    assert verifier.rejection(decoded, received_at=decoded.occurred_at, stored_data=slipped) == "bad_signature"


# ---- the acceptance rule ------------------------------------------------------------------------------------


def test_every_reason_is_one_of_the_documented_ones():
    assert REJECTION_REASONS == ("unsigned", "unknown_signer", "removed_signer", "bad_signature",
                                 "role_may_not_emit", "node_mismatch", "wrong_stream", "future_dated", "unapplicable",
                                 "duplicate", "too_old", "newer_hearth")


def test_unsigned_and_half_signed_events_are_rejected(verifier):
    event = own_advertisement("host0")
    assert verdict(verifier, event) == "unsigned"
    assert verdict(verifier, event.model_copy(update={"signer": KEYS["host0"].public_key})) == "unsigned"


def test_a_key_outside_the_roster_is_an_unknown_signer(verifier):
    assert verdict(verifier, sign_event(own_advertisement("host0"), KEYS["outsider"])) == "unknown_signer"


def test_a_changed_field_or_a_borrowed_signer_breaks_the_signature(verifier):
    signed = sign_event(own_advertisement("host0"), KEYS["host0"])
    assert verdict(verifier, signed.model_copy(update={"layer_hi": 7})) == "bad_signature"
    # host1's signature with host0's key named as signer.
    forged = sign_event(own_advertisement("host0"), KEYS["host1"]).model_copy(
        update={"signer": KEYS["host0"].public_key})
    assert verdict(verifier, forged) == "bad_signature"
    assert verdict(verifier, signed.model_copy(update={"signature": "not base64!"})) == "bad_signature"


@pytest.mark.parametrize("signer,event", [
    ("alice", own_advertisement("alice")),  # a client may emit nothing
    ("hub", own_advertisement("hub")),  # an orchestrator emits no shard events
    ("host0", completed("host0")),  # a shard host emits no pipeline events
])
def test_a_role_may_emit_only_its_own_families(verifier, signer, event):
    assert verdict(verifier, sign_event(event, KEYS[signer])) == "role_may_not_emit"


def test_a_host_speaks_only_for_its_own_node_and_shards(verifier):
    host1_shard = shard_id_for(MODEL_ID, 0, 3, "host1")
    claims_host1 = ShardWithdrawn(node_id="host1", shard_id=host1_shard, reason="forged", occurred_at=T0)
    own_node_other_shard = ShardWithdrawn(node_id="host0", shard_id=host1_shard, reason="forged", occurred_at=T0)
    redirected = own_advertisement("host0", control_subject=shard_control_subject("host1", host1_shard))
    for event in (claims_host1, own_node_other_shard, redirected):
        assert verdict(verifier, sign_event(event, KEYS["host0"])) == "node_mismatch", event
    assert verdict(verifier, sign_event(completed("hub-2"), KEYS["hub"])) == "node_mismatch"


def test_occurred_at_may_lead_the_broker_by_the_skew_and_no_more(verifier):
    stored_at = at(0)
    within = sign_event(own_advertisement("host0", t=SKEW_S - 1), KEYS["host0"])
    beyond = sign_event(own_advertisement("host0", t=SKEW_S + 1), KEYS["host0"])
    long_ago = sign_event(own_advertisement("host0", t=-3600), KEYS["host0"])
    assert verdict(verifier, within, stored_at=stored_at) is None
    assert verdict(verifier, beyond, stored_at=stored_at) == "future_dated"
    assert verdict(verifier, long_ago, stored_at=stored_at) is None


def test_a_member_added_to_the_roster_file_after_start_is_known_at_once(tmp_path):
    path = tmp_path / "roster.json"
    community_roster(("hub",)).save(path)
    verifier = EventVerifier(RosterFile(path, recheck_interval_s=3600), max_clock_skew_s=SKEW_S)
    event = sign_event(own_advertisement("host0"), KEYS["host0"])
    assert verdict(verifier, event) == "unknown_signer"
    community_roster(("hub", "host0")).save(path)
    assert verdict(verifier, event) is None


def test_a_removed_member_s_events_stored_before_its_removal_still_apply_and_later_ones_do_not(tmp_path):
    path = tmp_path / "roster.json"
    community_roster().save(path)
    verifier = EventVerifier(RosterFile(path, recheck_interval_s=0.0), max_clock_skew_s=SKEW_S)
    before, after = (sign_event(own_advertisement("host0", t=t), KEYS["host0"]) for t in (10, 20))
    assert verdict(verifier, before) is None
    community_roster().without_member("host0", removed_at=at(15)).save(path)
    # Judged by when the broker stored each, so a rebuild long after the removal applies what the live one did.
    assert verdict(verifier, before) is None
    assert verdict(verifier, after) == "removed_signer"
    assert verdict(verifier, before, stored_at=at(16)) == "removed_signer"
    # The removed member's old key still proves nothing it did not sign.
    assert verdict(verifier, before.model_copy(update={"layer_hi": 7})) == "bad_signature"
    assert verdict(verifier, sign_event(completed("host0", t=10), KEYS["host0"])) == "role_may_not_emit"


def test_a_removal_saved_after_the_roster_was_last_read_counts_for_events_stored_after_it(tmp_path):
    path = tmp_path / "roster.json"
    community_roster().save(path)
    verifier = EventVerifier(RosterFile(path, recheck_interval_s=3600), max_clock_skew_s=SKEW_S)
    event = sign_event(own_advertisement("host0"), KEYS["host0"])
    assert verdict(verifier, event) is None
    removed_at = datetime.now(timezone.utc)
    community_roster().without_member("host0", removed_at=removed_at).save(path)
    # Read live right after the removal: judged as a rebuild will judge it, not by the roster read an hour ago.
    assert verdict(verifier, event, stored_at=removed_at + timedelta(milliseconds=1)) == "removed_signer"


# ---- the projection ---------------------------------------------------------------------------------------


def test_the_projection_keeps_rejected_events_out_of_the_rows_and_still_moves_on(tmp_path, verifier):
    engine = migrated_engine(tmp_path / "rm.db")
    good = sign_event(own_advertisement("host0"), KEYS["host0"])
    forged = own_advertisement("host1")
    future = sign_event(own_advertisement("host1", t=3600), KEYS["host1"])
    messages = [stored(good, 1), stored(forged, 2), stored(future, 3, stored_at=at(0))]
    rejections: list[Rejection] = []
    try:
        with Session(engine) as session, session.begin():
            applied = ReadModelProjection(verifier=verifier).apply_many(session, messages, rejections=rejections)
        assert applied == 3
        assert [(r.seq, r.reason) for r in rejections] == [(2, "unsigned"), (3, "future_dated")]
        with Session(engine) as session:
            assert [row.shard_id for row in session.scalars(select(Shard))] == [good.shard_id]
            rejected = session.scalars(select(RejectedEvent).order_by(RejectedEvent.stream_seq)).all()
            assert load_positions(session) == {SHARDS_STREAM: 3}
        assert [(r.stream_seq, r.event_id, r.node_id, r.signer, r.reason) for r in rejected] == [
            (2, forged.event_id, "host1", None, "unsigned"),
            (3, future.event_id, "host1", KEYS["host1"].public_key, "future_dated")]
        assert rejected[1].occurred_at - rejected[1].rejected_at == 3600
        # Applying the same messages again (a redelivery) rejects nothing twice.
        again: list[Rejection] = []
        with Session(engine) as session, session.begin():
            assert ReadModelProjection(verifier=verifier).apply_many(session, messages, rejections=again) == 0
        assert again == []
    finally:
        engine.dispose()


def test_without_a_verifier_every_event_is_applied_as_before(tmp_path):
    engine = migrated_engine(tmp_path / "rm.db")
    try:
        with Session(engine) as session, session.begin():
            ReadModelProjection().apply_many(session, [stored(own_advertisement("host1"))])
        with Session(engine) as session:
            assert session.scalars(select(Shard)).one().node_id == "host1"
            assert session.scalars(select(RejectedEvent)).all() == []
    finally:
        engine.dispose()



def test_a_signed_event_counts_only_on_its_own_subject(verifier):
    """The signature covers the event, not where it was published: a member that may publish on some event subject
    could store another member's signed event there (an orchestrator a shard host's in the pipelines stream, a shard
    host an orchestrator's in the shards stream or another host's under its own node) and have it applied again. An
    event is judged where it is stored, so it counts only on its own subject."""
    advert = sign_event(own_advertisement("host0"), KEYS["host0"])
    done = sign_event(completed("hub"), KEYS["hub"])

    def where(event, stream, subject):
        return verifier.rejection(event, received_at=event.occurred_at, stored_data=encode_event(event),
                                  position=StreamPosition(stream, 7, subject))

    assert where(advert, SHARDS_STREAM, event_subject(advert)) is None
    assert where(done, PIPELINES_STREAM, event_subject(done)) is None
    host1_subject = event_subject(advert).replace(".host0.", ".host1.")
    for event, stream, subject in (
            (advert, PIPELINES_STREAM, "hearth.events.pipeline.p-9.advertised"),  # an orchestrator's replay
            (done, SHARDS_STREAM, "hearth.events.shard.host1.abcdef012345.completed"),  # a shard host's replay
            (advert, SHARDS_STREAM, host1_subject),  # host1 re-publishing host0's event under its own node
            (done, PIPELINES_STREAM, "hearth.events.pipeline.p-other.completed")):  # another pipeline's subject
        assert where(event, stream, subject) == "wrong_stream", (event.type, subject)
    # Without the subject (callers that know only the stream), the stream is still checked.
    assert verifier.rejection(advert, received_at=advert.occurred_at,
                              position=StreamPosition(PIPELINES_STREAM, 7)) == "wrong_stream"
    assert verifier.rejection(advert, received_at=advert.occurred_at,
                              position=StreamPosition(SHARDS_STREAM, 7)) is None



def test_the_projection_does_not_count_a_completed_call_again_from_another_subject(tmp_path, verifier):
    """A pipeline.completed adds its tokens to each hop's host's day (host_tokens_daily): a copy re-published under
    another pipeline's subject (after the broker's de-duplication window) must not add them again."""
    engine = migrated_engine(tmp_path / "copy.db")
    done = sign_event(completed("hub"), KEYS["hub"])
    copy = StoredEvent(stream=PIPELINES_STREAM, seq=2, subject="hearth.events.pipeline.p-copy.completed",
                       time=done.occurred_at, headers={}, event=done, data=encode_event(done))
    rejections: list[Rejection] = []
    try:
        with Session(engine) as session, session.begin():
            ReadModelProjection(verifier=verifier).apply_many(session, [stored(done), copy], rejections=rejections)
        assert [(r.seq, r.reason) for r in rejections] == [(2, "wrong_stream")]
    finally:
        engine.dispose()
