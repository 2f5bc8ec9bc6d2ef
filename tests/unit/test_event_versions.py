"""Events of another hearth version (hearth/events/models.py, decode_event): an older version of a type is brought
forward by its upcasters, while a newer version (a breaking change this hearth cannot read) or a type this hearth does
not know is refused in one line naming it, never read as if it were this hearth's own."""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from hearth.events import consume
from hearth.events.consume import SkippedMessage, decode_stored_message
from hearth.events.newer_hearth import NewerHearthNotices
from hearth.events.models import ShardAdvertised, decode_event
from hearth.events.signing import EventVerifier, canonical_json
from hearth.events.streams import SHARDS_STREAM
from hearth.protocol.mesh_protocol import MESH_PROTOCOL
from hearth.protocol.subjects import EVENTS_PREFIX, shard_control_subject, shard_key
from hearth.readmodels.db import upgrade_database
from hearth.readmodels.positions import PROJECTION_NAME, load_positions
from hearth.readmodels.projection import ReadModelProjection
from hearth.readmodels.tables import RejectedEvent, Shard
from hearth.trust.keys import MemberKey
from hearth.trust.roster import new_member, new_roster
from tests.readmodel_helpers import T0, migrated_engine

RECORDED = Path(__file__).resolve().parents[1] / "data" / "before_protocol_versions" / "shard_advertised.json"


def recorded_advert(**changes) -> bytes:
    return json.dumps({**json.loads(RECORDED.read_text()), **changes}).encode()


def test_an_event_of_an_older_hearth_reads():
    event = decode_event(recorded_advert())
    assert isinstance(event, ShardAdvertised) and event.protocol is None


def test_a_newer_version_of_a_known_type_is_refused_naming_both_versions():
    with pytest.raises(ValueError) as refused:
        decode_event(recorded_advert(version=2))
    assert str(refused.value) == ("shard.advertised version 2 is newer than this hearth reads (up to 1): "
                                  "upgrade it to read this event")


def test_a_type_this_hearth_does_not_know_is_refused_naming_it_and_skipped():
    skipped = decode_stored_message("HEARTH_SHARDS", 7, "hearth.events.shard.attic.x.moved", T0, None,
                                    recorded_advert(type="shard.moved"))
    assert isinstance(skipped, SkippedMessage)
    assert skipped.error == ("event type 'shard.moved' is not one this hearth knows (a newer hearth's?): "
                             "upgrade it to read this event")


# ---- a newer hearth's events in a projection --------------------------------------------------------------------

HOST_KEY = MemberKey.generate()
ROSTER = new_roster("test").with_member(new_member("attic", "shard", HOST_KEY.public_key))


def signed_body(**changes) -> bytes:
    """The recorded advert of `attic`, changed as a newer hearth would write it, signed by attic's key."""
    body = {**json.loads(recorded_advert()), "occurred_at": T0.isoformat(), "signer": HOST_KEY.public_key,
            "protocol": MESH_PROTOCOL, **changes}
    body["control_subject"] = shard_control_subject("attic", body["shard_id"])
    body.pop("signature", None)
    body["signature"] = HOST_KEY.sign_b64(canonical_json(body))
    return json.dumps(body).encode()


def as_stored(seq: int, data: bytes):
    """As a projector reads it from where attic publishes its shard's events."""
    kind = str(json.loads(data).get("type", "")) if data.startswith(b"{") else ""
    subject = f"{EVENTS_PREFIX}.shard.attic.{shard_key('tiny-llama:0-5@attic')}.{kind.partition('.')[2]}"
    return decode_stored_message(SHARDS_STREAM, seq, subject, T0 + timedelta(seconds=1), None, data)


def newer_hearth_warnings(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.levelno >= logging.WARNING and "newer" in record.getMessage()]


def test_a_newer_hearths_events_are_kept_as_rejected_naming_them_and_told_once(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(consume, "newer_hearth_notices", NewerHearthNotices())  # nothing told yet in this process
    engine = migrated_engine(tmp_path / "rm.db")
    moved = [signed_body(type="shard.relocated", event_id=f"{seq:032x}") for seq in (2, 3, 4)]
    version_2 = signed_body(version=3, event_id=f"{5:032x}")
    messages = [as_stored(1, signed_body()), *(as_stored(seq, data) for seq, data in enumerate(moved, 2)),
                as_stored(5, version_2), as_stored(6, signed_body(gpu="a field a newer hearth added",
                                                                  event_id=f"{6:032x}"))]
    rejections: list = []
    caplog.set_level(logging.WARNING)
    with Session(engine) as session, session.begin():
        applied = ReadModelProjection(verifier=EventVerifier(ROSTER, max_clock_skew_s=30)).apply_many(
            session, messages, rejections=rejections)
    assert applied == 6
    with Session(engine) as session:
        assert load_positions(session, PROJECTION_NAME)[SHARDS_STREAM] == 6
        assert [row.shard_id for row in session.scalars(select(Shard))] == ["tiny-llama:0-5@attic"]
        kept = [(row.stream_seq, row.type, row.reason, row.node_id, row.signer, row.event_id)
                for row in session.scalars(select(RejectedEvent).order_by(RejectedEvent.stream_seq))]
    assert kept == [(seq, "shard.relocated", "newer_hearth", "attic", HOST_KEY.public_key, f"{seq:032x}")
                    for seq in (2, 3, 4)] + [
        (5, "shard.advertised version 3", "newer_hearth", "attic", HOST_KEY.public_key, f"{5:032x}")]
    assert [rejection.reason for rejection in rejections] == ["newer_hearth"] * 4
    # One line per type and version, however many of its events come: never one per event.
    told = newer_hearth_warnings(caplog)
    assert len(told) == 2, told
    assert "'shard.relocated' is not one this hearth knows" in told[0]
    assert "shard.advertised version 3 is newer than this hearth reads (up to 1)" in told[1]
    engine.dispose()


def test_a_newer_hearths_event_no_member_signed_is_kept_for_that_not_as_a_newer_hearths(tmp_path, caplog):
    # Its type's rules are the newer hearth's, but its signature is checked as any event's: a forged, unsigned or
    # outsider's event of an unknown type is no newer hearth's event to keep for a newer projector.
    stranger = MemberKey.generate()
    forged = json.loads(signed_body(type="shard.relocated", event_id=f"{2:032x}"))
    forged["node_id"] = "elsewhere"  # changed after signing
    unsigned = {**json.loads(signed_body(type="shard.relocated", event_id=f"{3:032x}")), "signature": None}
    outsider = {**json.loads(signed_body(type="shard.relocated", event_id=f"{4:032x}")), "signer": stranger.public_key}
    outsider.pop("signature")
    outsider["signature"] = stranger.sign_b64(canonical_json(outsider))
    bodies = (forged, unsigned, outsider)
    messages = [as_stored(1, signed_body(type="shard.relocated", event_id=f"{1:032x}")),
                *(as_stored(seq, json.dumps(body).encode()) for seq, body in enumerate(bodies, 2))]
    engine = migrated_engine(tmp_path / "rm.db")
    rejections: list = []
    caplog.set_level(logging.WARNING)
    with Session(engine) as session, session.begin():
        ReadModelProjection(verifier=EventVerifier(ROSTER, max_clock_skew_s=30)).apply_many(
            session, messages, rejections=rejections)
    with Session(engine) as session:
        kept = [(row.stream_seq, row.type, row.reason)
                for row in session.scalars(select(RejectedEvent).order_by(RejectedEvent.stream_seq))]
    assert kept == [(1, "shard.relocated", "newer_hearth"), (2, "shard.relocated", "bad_signature"),
                    (3, "shard.relocated", "unsigned"), (4, "shard.relocated", "unknown_signer")]
    assert [rejection.reason for rejection in rejections] == ["newer_hearth", "bad_signature", "unsigned",
                                                              "unknown_signer"]
    assert any("bad_signature" in record.getMessage() for record in caplog.records)
    engine.dispose()


def test_a_message_that_is_no_event_at_all_is_skipped_and_not_kept_as_a_newer_hearths(tmp_path):
    """Nor is a known type's event with a value its field does not list: a new value is a breaking change."""
    engine = migrated_engine(tmp_path / "rm.db")
    messages = [as_stored(1, b"[1, 2]"), as_stored(2, json.dumps({"type": "shard.moved"}).encode()),
                as_stored(3, signed_body(device_kind="rocm"))]
    with Session(engine) as session, session.begin():
        assert ReadModelProjection().apply_many(session, messages) == 3
    with Session(engine) as session:
        assert session.scalars(select(RejectedEvent)).all() == []
    engine.dispose()


def test_an_upgrade_tells_of_events_kept_as_a_newer_hearths_that_this_one_reads(tmp_path, caplog):
    path = tmp_path / "rm.db"
    upgrade_database(path)
    with contextlib.closing(sqlite3.connect(path)) as connection, connection:
        for seq, label, reason in [(1, "shard.advertised", "newer_hearth"), (2, "shard.advertised", "newer_hearth"),
                                   (3, "shard.relocated", "newer_hearth"), (4, "shard.advertised version 9",
                                                                            "newer_hearth"),
                                   (5, "shard.heartbeat", "unsigned")]:
            connection.execute("INSERT INTO rejected_events (stream, stream_seq, event_id, type, node_id, signer, "
                               "reason, occurred_at, rejected_at) VALUES (?, ?, ?, ?, 'attic', NULL, ?, 0, 0)",
                               (SHARDS_STREAM, seq, f"e{seq}", label, reason))
    caplog.set_level(logging.WARNING)
    upgrade_database(path)  # as a newer hearth's projector, `hearth db upgrade` or rebuild opens it
    told = [record.getMessage() for record in caplog.records if "newer hearth" in record.getMessage()]
    assert told == [f"{path}: an older hearth's projector skipped events of a newer hearth that this one reads "
                    f"(shard.advertised (2); kept as rejected newer_hearth) and never applied them: rebuild this read "
                    f"model from the log to apply them (hearth-replay rebuild --db {path} --force; a rebuild holds "
                    f"only what the log still does, so take a hearth db backup first)"]


@pytest.mark.parametrize("kind", ["shard.advertised version 1", "shard.advertised version \u00b2"])
def test_a_type_no_hearth_could_name_is_not_kept_as_a_newer_hearths_nor_read_as_a_known_version(tmp_path, caplog,
                                                                                                 kind):
    """A member's event whose type only looks like a rejected row's label of a known type ("TYPE version N") would
    otherwise tell every upgraded read model to rebuild itself, or stop its start (a digit int() does not read)."""
    path = tmp_path / "rm.db"
    engine = migrated_engine(path)
    with Session(engine) as session, session.begin():
        assert ReadModelProjection(verifier=EventVerifier(ROSTER, max_clock_skew_s=30)).apply_many(
            session, [as_stored(1, signed_body(type=kind))]) == 1
    with Session(engine) as session:
        assert session.scalars(select(RejectedEvent)).all() == []
    engine.dispose()
    caplog.set_level(logging.WARNING)
    upgrade_database(path)
    assert [record.getMessage() for record in caplog.records if "newer hearth" in record.getMessage()] == []


def test_an_upgrade_reads_a_kept_label_whose_version_is_no_plain_number_as_unreadable(tmp_path, caplog):
    """A row an earlier hearth kept under such a type still lets the read model open."""
    path = tmp_path / "rm.db"
    upgrade_database(path)
    with contextlib.closing(sqlite3.connect(path)) as connection, connection:
        connection.execute("INSERT INTO rejected_events (stream, stream_seq, event_id, type, node_id, signer, reason, "
                           "occurred_at, rejected_at) VALUES (?, 1, 'e1', ?, 'attic', NULL, 'newer_hearth', 0, 0)",
                           (SHARDS_STREAM, "shard.advertised version \u00b2"))
    caplog.set_level(logging.WARNING)
    upgrade_database(path)
    assert [record.getMessage() for record in caplog.records if "newer hearth" in record.getMessage()] == []
