"""A member's removal is a position in each stream, not a time on the steward's clock: a steward's signed
`member.removed` cuts off what the member's key signed after it on that stream, in the live projection and in a
rebuild alike, whatever the steward's clock said; the roster's cut stands in for an event past retention, and the
roster's time only where no removal event was ever published."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from hearth.events.consume import StoredEvent
from hearth.events.models import MemberChange, MemberRemoved, encode_event
from hearth.events.signing import EventVerifier, StreamPosition, sign_event
from hearth.events.streams import MEMBER_REMOVAL_SUBJECTS, PIPELINES_STREAM, SHARDS_STREAM
from hearth.protocol.subjects import event_subject, shard_control_subject, shard_id_for
from hearth.readmodels.projection import ReadModelProjection
from hearth.readmodels.rebuild import diff_databases
from hearth.readmodels.tables import MemberRemoval, RejectedEvent, ShardHealth
from hearth.trust.keys import MemberKey
from hearth.trust.roster import SYSTEM_MEMBER, RemovalCut, Roster, new_member, new_roster
from tests.readmodel_helpers import MODEL_ID, advertised, at, heartbeat, migrated_engine

SKEW_S = 30.0
STEWARD, ATTIC, HUB = MemberKey.generate(), MemberKey.generate(), MemberKey.generate()
SHARD_ID = shard_id_for(MODEL_ID, 0, 3, "attic")
REMOVAL_SEQ = 5  # the removal event's place in HEARTH_SHARDS; the broker stores it at t=35
REMOVED_AT_S = 35


def roster_with_attic() -> Roster:
    roster = new_roster("test")
    members = ((SYSTEM_MEMBER, "system", STEWARD), ("attic", "shard", ATTIC), ("hub", "orchestrator", HUB))
    for name, role, key in members:
        roster = roster.with_member(new_member(name, role, key.public_key))
    return roster


def roster_without_attic(*, steward_clock_skew_s: float = 0.0, cuts=()) -> Roster:
    """The roster after the removal, its `removed_at` read off a steward's clock that is `steward_clock_skew_s` off."""
    return roster_with_attic().without_member("attic", removed_at=at(REMOVED_AT_S + steward_clock_skew_s), cuts=cuts)


def removal(stream: str = SHARDS_STREAM, *, key: MemberKey = STEWARD, node: str = SYSTEM_MEMBER,
            t: float = REMOVED_AT_S) -> MemberRemoved:
    event = MemberRemoved(node_id=node, member="attic", public_key=ATTIC.public_key, stream=stream,
                          occurred_at=at(t))
    return sign_event(event, key)  # type: ignore[return-value]


def stored(event, seq: int, stream: str = SHARDS_STREAM) -> StoredEvent:
    subject = MEMBER_REMOVAL_SUBJECTS[event.stream] if isinstance(event, MemberChange) else event_subject(event)
    return StoredEvent(stream=stream, seq=seq, subject=subject, time=event.occurred_at, headers={}, event=event,
                       data=encode_event(event))


def attic_log(removal_event: MemberRemoved | None = None) -> list[StoredEvent]:
    """attic's advert, heartbeats stored at t=10..30, the steward's removal at seq 5 (t=35), then heartbeats at
    t=40..60 that the broker took before it refused the key (a broker reloaded by hand, say)."""
    advert = advertised(0, 3, "attic", control_subject=shard_control_subject("attic", SHARD_ID), t=0)
    before = [heartbeat(SHARD_ID, t=t, node="attic", tokens=t) for t in (10, 20, 30)]
    after = [heartbeat(SHARD_ID, t=t, node="attic", tokens=t) for t in (40, 50, 60)]
    events = [sign_event(event, ATTIC) for event in (advert, *before)]
    events.append(removal_event or removal())
    events += [sign_event(event, ATTIC) for event in after]
    return [stored(event, seq) for seq, event in enumerate(events, 1)]


def project(path, roster: Roster, batches: list[list[StoredEvent]]) -> list[tuple[int, str]]:
    """Apply each batch in a transaction of its own (a projector restarted between them keeps what it learnt);
    returns the rejected (seq, reason)."""
    engine = migrated_engine(path)
    try:
        for batch in batches:
            with Session(engine) as session, session.begin():
                verifier = EventVerifier(roster, max_clock_skew_s=SKEW_S)
                ReadModelProjection(verifier=verifier).apply_many(session, batch)
        with Session(engine) as session:
            return [(row.stream_seq, row.reason) for row in
                    session.scalars(select(RejectedEvent).order_by(RejectedEvent.stream_seq))]
    finally:
        engine.dispose()


def latest_tokens(path) -> int:
    engine = migrated_engine(path)
    with Session(engine) as session:
        value = session.get(ShardHealth, SHARD_ID).tokens_served_total
    engine.dispose()
    return value


AFTER_THE_REMOVAL = [(6, "removed_signer"), (7, "removed_signer"), (8, "removed_signer")]


@pytest.mark.parametrize("steward_clock_skew_s", [-20.0, 0.0, 20.0], ids=["slow", "right", "fast"])
def test_the_removal_event_cuts_at_its_position_live_and_in_a_rebuild_whatever_the_stewards_clock(
        tmp_path, steward_clock_skew_s):
    log = attic_log()
    # Live: the projector reads the removal event before the steward has saved the roster (attic still a member).
    live = tmp_path / "live.db"
    assert project(live, roster_with_attic(), [log[:5], log[5:]]) == AFTER_THE_REMOVAL
    # A rebuild long after, with the roster as saved: a slow steward clock rejected heartbeats 3 and 4, a fast one
    # applied 6 and 7; the cut is where the event is.
    cuts = [RemovalCut(stream=SHARDS_STREAM, seq=REMOVAL_SEQ, event_id=log[4].event.event_id)]
    rebuilt = tmp_path / "rebuilt.db"
    assert project(rebuilt, roster_without_attic(steward_clock_skew_s=steward_clock_skew_s, cuts=cuts),
                   [log]) == AFTER_THE_REMOVAL
    assert latest_tokens(rebuilt) == 30
    assert diff_databases(rebuilt, live) == []


def test_the_rosters_cut_stands_in_for_a_removal_event_past_retention(tmp_path):
    log = attic_log()
    cuts = [RemovalCut(stream=SHARDS_STREAM, seq=REMOVAL_SEQ, event_id=log[4].event.event_id)]
    # The oldest messages went, the removal event with them; its cut is still in the roster.
    rejected = project(tmp_path / "rm.db", roster_without_attic(steward_clock_skew_s=20.0, cuts=cuts), [log[5:]])
    assert rejected == AFTER_THE_REMOVAL


def test_without_a_removal_event_or_cut_the_stewards_clock_is_the_fallback(tmp_path):
    """An older community's removal: judged by its time, so a steward clock 20 s slow rejects heartbeats 3 and 4."""
    log = attic_log()
    del log[4]
    rejected = project(tmp_path / "rm.db", roster_without_attic(steward_clock_skew_s=-20.0), [log])
    assert [seq for seq, _ in rejected] == [3, 4, 6, 7, 8]


def test_the_removal_is_kept_where_it_was_first_seen_and_survives_a_restart(tmp_path):
    log = attic_log()
    copy = stored(removal(t=70), 9)
    path = tmp_path / "rm.db"
    assert project(path, roster_with_attic(), [log[:5], [*log[5:], copy]]) == AFTER_THE_REMOVAL
    engine = migrated_engine(path)
    with Session(engine) as session:
        [row] = session.scalars(select(MemberRemoval)).all()
    engine.dispose()
    assert (row.stream, row.public_key, row.member, row.event_id, row.removed_at) == (
        SHARDS_STREAM, ATTIC.public_key, "attic", log[4].event.event_id, int(at(REMOVED_AT_S).timestamp()))


@pytest.mark.parametrize("forged, reason", [
    (removal(key=HUB, node="hub"), "role_may_not_emit"),  # only the steward removes a member
    (removal(key=ATTIC, node="attic"), "role_may_not_emit"),
    (removal().model_copy(update={"member": "someone"}), "bad_signature"),
    (removal(PIPELINES_STREAM), "wrong_stream"),  # the steward's, but it marks a position of the other stream
], ids=["by-an-orchestrator", "by-itself", "altered", "for-the-other-stream"])
def test_a_removal_not_the_stewards_for_this_stream_cuts_nothing(tmp_path, forged, reason):
    rejected = project(tmp_path / "rm.db", roster_with_attic(), [attic_log(forged)])
    assert rejected == [(REMOVAL_SEQ, reason)]


def test_the_verifier_sets_a_removed_members_events_against_the_cut_of_their_own_stream():
    cuts = [RemovalCut(stream=SHARDS_STREAM, seq=REMOVAL_SEQ, event_id="e")]
    verifier = EventVerifier(roster_without_attic(steward_clock_skew_s=-20.0, cuts=cuts), max_clock_skew_s=SKEW_S)
    beat = sign_event(heartbeat(SHARD_ID, t=30, node="attic"), ATTIC)

    def verdict(position, *, removal_logged=False):
        return verifier.rejection(beat, received_at=beat.occurred_at, position=position, removal_logged=removal_logged)

    assert verdict(StreamPosition(SHARDS_STREAM, REMOVAL_SEQ - 1)) is None
    assert verdict(StreamPosition(SHARDS_STREAM, REMOVAL_SEQ + 1)) == "removed_signer"
    # A stream without a cut, or no position given: the removal's time (here 20 s early) decides.
    assert verdict(StreamPosition(PIPELINES_STREAM, 1)) == "removed_signer"
    assert verdict(None) == "removed_signer"
    assert verifier.rejection(beat, received_at=at(0), position=None) is None
    # A removal the stream showed before counts even while the roster still lists the member.
    member_verifier = EventVerifier(roster_with_attic(), max_clock_skew_s=SKEW_S)
    assert member_verifier.rejection(beat, received_at=beat.occurred_at, position=StreamPosition(SHARDS_STREAM, 9),
                                     removal_logged=True) == "removed_signer"
    assert member_verifier.rejection(beat, received_at=beat.occurred_at + timedelta(days=1),
                                     position=StreamPosition(SHARDS_STREAM, 9)) is None


def test_a_stream_created_again_still_cuts_by_when_the_broker_stored_the_removal():
    removal_stored = at(REMOVED_AT_S)
    cuts = [RemovalCut(stream=SHARDS_STREAM, seq=REMOVAL_SEQ, event_id="e", stored_at=removal_stored)]
    verifier = EventVerifier(roster_without_attic(cuts=cuts), max_clock_skew_s=SKEW_S)
    # The stream wiped and created again: its messages are numbered from 1, below the cut.
    replayed = sign_event(heartbeat(SHARD_ID, t=REMOVED_AT_S + 10 * 86_400, node="attic"), ATTIC)
    assert verifier.rejection(replayed, received_at=replayed.occurred_at,
                              position=StreamPosition(SHARDS_STREAM, 2)) == "removed_signer"
    # Before the removal, in the stream as it was: still the member's.
    before = sign_event(heartbeat(SHARD_ID, t=REMOVED_AT_S - 5, node="attic"), ATTIC)
    assert verifier.rejection(before, received_at=before.occurred_at,
                              position=StreamPosition(SHARDS_STREAM, REMOVAL_SEQ - 1)) is None
