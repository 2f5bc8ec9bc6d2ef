"""`hearth-replay shard`'s verification part: totals, each mismatch with its witnesses, position, error against
tolerance and digest, disputes, clearings and their effect, the status the read model derives, and a quarantine of
another shard of the node holding this one out of routing."""

from __future__ import annotations

from datetime import timedelta

from hearth.events.consume import StoredEvent
from hearth.protocol.subjects import event_subject, shard_key
from hearth.services.replay.shard_view import evidence_lines, names_shard, shapes_quarantines, shard_view_lines
from tests.readmodel_helpers import T0, advertised, at
from tests.reputation_events import EVIDENCE_SHA, cleared, confirmed, disputed, verified

A, B, C = (advertised(0, 3, node).shard_id for node in ("node-a", "node-b", "node-c"))


def stored(events) -> list[StoredEvent]:
    return [StoredEvent(stream="HEARTH_PIPELINES", seq=n, subject=event_subject(e), time=e.occurred_at, headers={},
                        event=e) for n, e in enumerate(events, 1)]


def test_a_quarantined_shard_shows_its_evidence_and_how_to_clear_it():
    outcomes = stored([verified("p1", {A: (2, 40), B: (1, 9)}, t=1.0), verified("p2", {A: (1, 8)}, t=2.0),
                       disputed("p3", [A, C], t=3.0), confirmed("p4", A, [B, C], t=4.0)])
    lines = evidence_lines(A, outcomes)
    assert lines[0].startswith(f"verification: status QUARANTINED since {T0:%Y-%m-%d}T12:00:04.000Z (event ")
    assert lines[1] == ("  3 checks found nothing wrong in 2 calls, 48 positions verified; 1 mismatches confirmed "
                        "against it, 1 disputed")
    assert f"disputed with {C} in pipeline p3" in lines[2]
    mismatch = lines[3]
    assert "mismatch confirmed in pipeline p4 (reported by hub)" in mismatch
    assert "layers 0-3 (none, float32) decode position 17: relative error 0.42 > tolerance 0.002" in mismatch
    assert f"evidence sha256 {EVIDENCE_SHA}" in mismatch and f"witnesses that agreed: {B}, {C}" in mismatch
    assert lines[-1] == f"  a steward clears it: hearth community clear-quarantine '{A}' --reason TEXT"


def test_clearings_say_whether_they_lifted_anything():
    outcomes = stored([cleared(A, t=1.0, clearing_id="clear-early"), confirmed("p1", A, [B, C], t=4.0),
                       cleared(A, t=9.0, reason="new GPU", clearing_id="clear-late")])
    lines = evidence_lines(A, outcomes)
    assert lines[0].startswith(f"verification: status ok since {T0:%Y-%m-%d}T12:00:09.000Z")
    early, late = (line for line in lines if "cleared by system" in line)
    assert "clear-early" in early and "changed nothing" in early
    assert "clear-late" in late and "'new GPU'; lifted the quarantine" in late
    assert not any("clear-quarantine" in line for line in lines)


def test_a_witness_is_not_blamed():
    lines = evidence_lines(B, stored([confirmed("p1", A, [B, C])]))
    assert lines[0] == "verification: 1 outcome events name it only as a witness"
    assert f"witness against {A} in pipeline p1" in lines[1]


def test_outcomes_are_matched_by_shard_id_or_shard_key():
    blame = confirmed("p1", A, [B, C])
    assert names_shard(blame, A, shard_key(A)) and names_shard(blame, shard_key(C), shard_key(C))
    assert not names_shard(blame, "tiny/m:0-3@elsewhere", shard_key("tiny/m:0-3@elsewhere"))
    assert names_shard(verified("p", {B: (1, 1)}), B, shard_key(B))
    assert names_shard(cleared(A), A, shard_key(A)) and not names_shard(cleared(A), B, shard_key(B))


def test_the_whole_view_has_the_life_then_the_evidence_and_works_from_the_key_alone():
    life = advertised(0, 3, "node-a")
    own = [StoredEvent(stream="HEARTH_SHARDS", seq=1, subject=event_subject(life), time=life.occurred_at,
                       headers={}, event=life)]
    outcomes = stored([confirmed("p1", A, [B, C], t=4.0)])
    now = at(5.0)
    lines = shard_view_lines(A, shard_key(A), own, outcomes, 30.0, now=now)
    assert lines[0].startswith(f"shard {A} (key {shard_key(A)}): 1 events")
    assert any(line.startswith("verification: status QUARANTINED") for line in lines)
    # Given as its key, with the shard's own events aged out of the log: the id is found in the evidence.
    key_only = shard_view_lines(shard_key(A), shard_key(A), [], outcomes, 30.0, now=now + timedelta(days=8))
    assert key_only[0] == f"shard {A} (key {shard_key(A)}): no shard events left in the log"
    assert key_only[1].startswith("verification: status QUARANTINED")
    assert shard_view_lines(A, shard_key(A), [], [], 30.0, now=now) == []


class RejectsClearingsFromOrchestrators:
    """Stands in for the community's EventVerifier: a clearing not from the steward is refused."""

    def rejection(self, event, *, received_at, stored_data=b"", position=None, removal_logged=False,
                  steward_succession=None, member_succession=None, member_addition=None):
        return "role_may_not_emit" if event.type.endswith("quarantine_cleared") and event.node_id != "system" else None


def test_with_the_communitys_check_a_forged_clearing_is_shown_rejected_and_not_applied():
    forged = cleared(A, t=9.0).model_copy(update={"node_id": "hub"})
    lines = evidence_lines(A, stored([confirmed("p1", A, [B, C], t=4.0), forged]),
                           RejectsClearingsFromOrchestrators())
    assert lines[0].startswith("verification: status QUARANTINED")
    assert any(f"REJECTED integrity.quarantine_cleared {forged.event_id} from hub (role_may_not_emit)" in line
               for line in lines)
    assert evidence_lines(A, stored([confirmed("p1", A, [B, C], t=4.0), forged]))[0].startswith(
        "verification: status ok")  # an open mesh applies every event, as its projector does


def test_a_shard_whose_node_is_held_by_a_sibling_quarantine_says_so_until_the_sibling_is_cleared():
    caught, restarted = A, advertised(0, 2, "node-a").shard_id  # the same node, another range: another shard id
    log = [confirmed("p1", caught, [B, C], t=4.0)]
    assert shapes_quarantines(log[0]) and shapes_quarantines(cleared(caught)) and not shapes_quarantines(verified(
        "p0", {caught: (1, 1)}))
    assert evidence_lines(restarted, stored(log)) == [
        f"routing: node node-a quarantined (shard {caught} mismatched): no shard of node-a is routed while {caught} "
        "is quarantined"]
    checked = stored([verified("p0", {restarted: (1, 4)}, t=1.0), *log])
    assert evidence_lines(restarted, checked)[0] == "verification: status ok"
    assert evidence_lines(restarted, checked)[-1].startswith("routing: node node-a quarantined")
    assert evidence_lines(restarted, stored([*log, cleared(caught, t=9.0)])) == []
    assert not any(line.startswith("routing:") for line in evidence_lines(caught, stored(log)))


def test_an_accusation_past_its_reporters_bound_says_it_quarantined_nobody():
    d = advertised(0, 3, "node-d").shard_id
    earlier = [confirmed("p1", B, [A, C], t=1.0), confirmed("p2", C, [A, B], t=2.0)]  # hub's word holds node-b, node-c
    lines = evidence_lines(d, stored([*earlier, confirmed("p3", d, [A, B], t=3.0)]))
    assert lines[0] == "verification: status ok"
    assert ("not quarantined: hub's checks already hold 2 nodes quarantined (node-b, node-c), the most one reporter's "
            "hold at once; a steward reads the evidence") in lines[2]
    assert not any("clear-quarantine" in line for line in lines)
    # Once a steward cleared one of them, the same accusation holds.
    freed = evidence_lines(d, stored([*earlier, cleared(B, t=2.5), confirmed("p3", d, [A, B], t=3.0)]))
    assert freed[0].startswith("verification: status QUARANTINED") and "not quarantined" not in freed[2]
