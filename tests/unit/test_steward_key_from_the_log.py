"""A rotation of the steward's own key is learnt from the log: the `member.key_rotated` of `system` that the steward
key a reader trusts signs makes the key it names the steward's on that stream from there on, in a live projection
(across restarts: kept in the read model) and in a rebuild alike, with a roster that still names the old key. Before,
everything the new key signed was `unknown_signer` until each household had a new roster copy. Only the trusted
steward key names a successor: a forged rotation, one by a retired steward key, and a log that contradicts the roster's
own chain of steward keys teach nothing."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from hearth.events.consume import StoredEvent
from hearth.events.models import MemberKeyRotated, MemberRemoved, encode_event
from hearth.events.signing import EventVerifier, sign_event
from hearth.events.streams import MEMBER_REMOVAL_SUBJECTS, PIPELINES_STREAM, SHARDS_STREAM
from hearth.protocol.subjects import event_subject, shard_control_subject, shard_id_for
from hearth.readmodels.projection import ReadModelProjection
from hearth.readmodels.rebuild import diff_databases
from hearth.readmodels.tables import MemberRemoval, RejectedEvent
from hearth.services.replay.shard_view import evidence_lines
from hearth.events.logged_keys import LoggedKeys
from hearth.services.replay.verify import PassedEvents, _verdict
from hearth.trust.keys import MemberKey
from hearth.trust.roster import SYSTEM_MEMBER, RemovalCut, Roster, new_member, new_roster
from tests.readmodel_helpers import MODEL_ID, advertised, at, heartbeat, migrated_engine
from tests.reputation_events import cleared, confirmed
from tests.unit.test_member_removal_cut import stored

SKEW_S = 30.0
STEWARD_0, STEWARD_1, STEWARD_2 = MemberKey.generate(), MemberKey.generate(), MemberKey.generate()
ATTIC, HUB, THIEF = MemberKey.generate(), MemberKey.generate(), MemberKey.generate()
SHARD_ID = shard_id_for(MODEL_ID, 0, 3, "attic")


def old_roster() -> Roster:
    """The roster every household was handed before the steward rotated its key."""
    roster = new_roster("test")
    for name, role, key in ((SYSTEM_MEMBER, "system", STEWARD_0), ("attic", "shard", ATTIC),
                            ("hub", "orchestrator", HUB)):
        roster = roster.with_member(new_member(name, role, key.public_key))
    return roster


def rotation(old: MemberKey, new: MemberKey, *, signer: MemberKey | None = None, t: float,
             node: str = SYSTEM_MEMBER, member: str = SYSTEM_MEMBER) -> MemberKeyRotated:
    event = MemberKeyRotated(node_id=node, member=member, public_key=old.public_key, new_public_key=new.public_key,
                             stream=SHARDS_STREAM, occurred_at=at(t))
    return sign_event(event, signer or old)  # type: ignore[return-value]


def removal_of(name: str, key: MemberKey, *, by: MemberKey, t: float) -> MemberRemoved:
    event = MemberRemoved(node_id=SYSTEM_MEMBER, member=name, public_key=key.public_key, stream=SHARDS_STREAM,
                          occurred_at=at(t))
    return sign_event(event, by)  # type: ignore[return-value]


def attic_beat(t: float):
    return sign_event(heartbeat(SHARD_ID, t=t, node="attic", tokens=int(t)), ATTIC)


def steward_log() -> list[StoredEvent]:
    advert = sign_event(advertised(0, 3, "attic", control_subject=shard_control_subject("attic", SHARD_ID), t=0),
                        ATTIC)
    events = [
        advert,                                                     # 1
        attic_beat(10),                                             # 2
        rotation(STEWARD_0, STEWARD_1, t=20),                       # 3  the steward's key passes to STEWARD_1
        rotation(STEWARD_0, MemberKey.generate(), signer=HUB, node="hub", t=21),  # 4 forged: a hub is no steward
        attic_beat(25),                                             # 5
        removal_of("attic", ATTIC, by=STEWARD_1, t=30),             # 6  the new steward key removes attic
        attic_beat(40),                                             # 7  after its removal
        rotation(STEWARD_0, THIEF, t=45),                           # 8  the leaked old key, after its own rotation
        removal_of("hub", HUB, by=THIEF, t=46),                     # 9  the thief's key was never the steward's
        rotation(STEWARD_1, STEWARD_2, t=50),                       # 10 a second rotation: STEWARD_1 -> STEWARD_2
        removal_of("hub", HUB, by=STEWARD_1, t=55),                 # 11 STEWARD_1, after its own rotation
        removal_of("hub", HUB, by=STEWARD_2, t=60),                 # 12 the steward as it stands now
    ]
    return [stored(event, seq) for seq, event in enumerate(events, 1)]


EXPECTED_REJECTIONS = [(4, "role_may_not_emit"), (7, "removed_signer"), (8, "removed_signer"),
                       (9, "unknown_signer"), (11, "removed_signer")]


def project(path, roster: Roster, batches: list[list[StoredEvent]]) -> tuple[list[tuple[int, str]], set[tuple]]:
    """Each batch in a transaction of its own, with a verifier made afresh (a projector restarted in between); returns
    the rejected (seq, reason) and the removals the read model keeps (member, key)."""
    engine = migrated_engine(path)
    try:
        for batch in batches:
            with Session(engine) as session, session.begin():
                ReadModelProjection(verifier=EventVerifier(roster, max_clock_skew_s=SKEW_S)).apply_many(session, batch)
        with Session(engine) as session:
            rejected = [(row.stream_seq, row.reason) for row in
                        session.scalars(select(RejectedEvent).order_by(RejectedEvent.stream_seq))]
            removals = {(row.member, row.public_key) for row in session.scalars(select(MemberRemoval))}
        return rejected, removals
    finally:
        engine.dispose()


def test_a_projector_with_the_old_roster_follows_the_stewards_rotations_in_the_log_across_restarts(tmp_path):
    log = steward_log()
    rejected, removals = project(tmp_path / "live.db", old_roster(), [log[:3], log[3:6], log[6:10], log[10:]])
    assert rejected == EXPECTED_REJECTIONS
    assert removals == {("attic", ATTIC.public_key), ("hub", HUB.public_key), (SYSTEM_MEMBER, STEWARD_0.public_key),
                        (SYSTEM_MEMBER, STEWARD_1.public_key)}


def test_a_rebuild_with_the_roster_as_the_steward_saved_it_rejects_the_same_events(tmp_path):
    log = steward_log()
    live = tmp_path / "live.db"
    project(live, old_roster(), [log[:3], log[3:]])
    cut = {seq: RemovalCut(stream=SHARDS_STREAM, seq=seq, event_id=log[seq - 1].event.event_id) for seq in (3, 10)}
    saved = old_roster().with_rotated_key(SYSTEM_MEMBER, STEWARD_1.public_key, retired_at=at(20), cuts=[cut[3]])
    saved = saved.with_rotated_key(SYSTEM_MEMBER, STEWARD_2.public_key, retired_at=at(50), cuts=[cut[10]])
    rebuilt = tmp_path / "rebuilt.db"
    rejected, _ = project(rebuilt, saved, [log])
    assert rejected == EXPECTED_REJECTIONS
    assert diff_databases(rebuilt, live) == []


def test_a_rotation_that_contradicts_the_rosters_chain_of_steward_keys_teaches_nothing(tmp_path):
    """A leaked old key that got its rotation into a stream first names the thief's key there; the roster the steward
    saved names the real successor, and the thief's key stays unknown."""
    log = [stored(rotation(STEWARD_0, THIEF, t=20), 1), stored(removal_of("hub", HUB, by=THIEF, t=30), 2)]
    cut = RemovalCut(stream=SHARDS_STREAM, seq=1, event_id=log[0].event.event_id)
    saved = old_roster().with_rotated_key(SYSTEM_MEMBER, STEWARD_1.public_key, retired_at=at(20), cuts=[cut])
    rejected, removals = project(tmp_path / "rm.db", saved, [log])
    assert rejected == [(2, "unknown_signer")]
    assert ("hub", HUB.public_key) not in removals


def test_a_rotation_of_another_members_key_names_no_steward(tmp_path):
    """The steward rotating attic's key passes attic's role on to the new key (hearth/events/member_keys.py), never
    the steward's: a shard host's key may not remove a member."""
    new_attic = MemberKey.generate()
    log = [stored(rotation(ATTIC, new_attic, signer=STEWARD_0, member="attic", t=20), 1),
           stored(removal_of("hub", HUB, by=new_attic, t=30), 2)]
    rejected, removals = project(tmp_path / "rm.db", old_roster(), [log])
    assert rejected == [(2, "role_may_not_emit")]
    assert ("hub", HUB.public_key) not in removals


def test_hearth_replay_verify_with_the_old_roster_follows_the_same_chain():
    logged, passed = LoggedKeys(), PassedEvents(None)
    verifier = EventVerifier(old_roster(), max_clock_skew_s=SKEW_S)
    verdicts = [_verdict(verifier, message, logged, passed) for message in steward_log()]
    assert [(bad.seq, bad.reason) for bad in verdicts if bad is not None] == EXPECTED_REJECTIONS


def test_hearth_replay_shard_shows_a_clearing_the_new_steward_key_signed_as_lifting_the_quarantine():
    """The evidence view reads the pipelines stream's rotations with its outcomes: with the old roster, a clearing
    signed by the new steward key lifts the quarantine, as in a projection (it was shown REJECTED unknown_signer)."""
    witnesses = [advertised(0, 3, node).shard_id for node in ("node-b", "node-c")]
    rotated = rotation(STEWARD_0, STEWARD_1, t=5).model_copy(update={"stream": PIPELINES_STREAM})
    events = [sign_event(confirmed("p1", SHARD_ID, witnesses, t=4.0), HUB), sign_event(rotated, STEWARD_0),
              sign_event(cleared(SHARD_ID, t=9.0), STEWARD_1)]
    outcomes = [StoredEvent(stream=PIPELINES_STREAM, seq=seq, time=event.occurred_at, headers={}, event=event,
                            subject=MEMBER_REMOVAL_SUBJECTS[PIPELINES_STREAM] if isinstance(event, MemberRemoved)
                            else event_subject(event), data=encode_event(event))
                for seq, event in enumerate(events, 1)]
    lines = evidence_lines(SHARD_ID, outcomes, EventVerifier(old_roster(), max_clock_skew_s=SKEW_S))
    assert lines[0].startswith("verification: status ok")
    assert not any("REJECTED" in line for line in lines)
