"""How far one reporter's word reaches: a member's confirmed mismatches hold at most MAX_NODES_HELD_PER_REPORTER nodes
quarantined at once (hearth/readmodels/reputation.py); past that, an accusation is kept as `unheld` evidence and
quarantines nobody, in the read model, in every batching of a rebuild, in the log's own view, and after migration
0016 for quarantines held before it."""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.orm import Session

from hearth.protocol.quarantine import MAX_NODES_HELD_PER_REPORTER
from hearth.readmodels.db import open_engine, upgrade_database
from hearth.readmodels.reputation import ReputationLog, nodes_held_by
from hearth.readmodels.tables import IntegrityEvidence, ShardReputation
from tests.readmodel_helpers import LogBuilder, advertised, apply_all, dump_rows, migrated_engine
from tests.reputation_events import cleared, confirmed

A, B, C, D = (advertised(0, 3, node).shard_id for node in ("node-a", "node-b", "node-c", "node-d"))
B_OTHER_RANGE = advertised(4, 7, "node-b").shard_id


def by(reporter: str, event):
    return event.model_copy(update={"node_id": reporter})


def rows(engine) -> dict[str, tuple[str, int, str | None]]:
    with Session(engine) as session:
        return {row.shard_id: (row.status, row.mismatches, row.quarantined_by)
                for row in session.query(ShardReputation)}


def kinds(engine) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    with Session(engine) as session:
        for row in session.query(IntegrityEvidence).order_by(IntegrityEvidence.occurred_at):
            found.setdefault(row.shard_id, []).append(row.kind)
    return found


def bound_story() -> list:
    """hub accuses node-b and node-c (held), then node-d (past its bound), another shard of node-b (a node its word
    holds already); elsewhere accuses node-d (its own word, held); a steward clears node-c and hub's word reaches a
    third node again."""
    e = advertised(0, 3, "node-e").shard_id
    return [confirmed("p1", B, [A, C], t=1.0), confirmed("p2", C, [A, B], t=2.0), confirmed("p3", D, [A, B], t=3.0),
            confirmed("p4", B_OTHER_RANGE, [A, C], t=4.0), cleared(C, t=5.0),
            confirmed("p5", e, [A, B], t=6.0), by("elsewhere", confirmed("p6", D, [A, B], t=7.0))]


def test_the_bound_is_two_nodes():
    assert MAX_NODES_HELD_PER_REPORTER == 2


def test_an_accusation_past_the_bound_is_kept_and_quarantines_nobody(tmp_path):
    engine = migrated_engine(tmp_path / "rm.db")
    log = LogBuilder()
    story = bound_story()
    apply_all(engine, [log.stored(event) for event in story[:4]])
    assert rows(engine) == {B: ("quarantined", 1, "hub"), C: ("quarantined", 1, "hub"), D: ("ok", 1, None),
                            B_OTHER_RANGE: ("quarantined", 1, "hub")}
    assert kinds(engine)[D] == ["unheld"] and kinds(engine)[B_OTHER_RANGE] == ["confirmed"]
    apply_all(engine, [log.stored(event) for event in story[4:]])
    e = story[5].shard_id
    state = rows(engine)
    assert state[C] == ("ok", 1, None) and state[e] == ("quarantined", 1, "hub")
    assert state[D] == ("quarantined", 2, "elsewhere")  # another member's word holds it
    assert kinds(engine)[D] == ["unheld", "confirmed"]
    engine.dispose()


def test_every_batching_and_the_logs_own_view_agree(tmp_path):
    story = bound_story()
    dumps, states = [], []
    for name, cuts in (("one", [len(story)]), ("each", list(range(1, len(story) + 1))), ("two", [3, len(story)])):
        engine = migrated_engine(tmp_path / f"{name}.db")
        log = LogBuilder()
        stored = [log.stored(event) for event in story]
        start = 0
        for cut in cuts:
            apply_all(engine, stored[start:cut])
            start = cut
        dumps.append(dump_rows(engine))
        states.append(rows(engine))
        engine.dispose()
    assert dumps[0] == dumps[1] == dumps[2]
    memory = ReputationLog()
    for event in story:
        memory.apply(event)
    assert {shard: (row["status"], row["mismatches"], row["quarantined_by"])
            for shard, row in ((shard, memory.reputation(shard)) for shard in states[0])} == states[0]
    assert nodes_held_by(memory, "hub") == {"node-b", "node-e"}


def _old_quarantine(connection, shard_id: str, node: str, event_id: str) -> None:
    """A quarantine as a read model before migration 0016 held it: its row and the evidence that set it."""
    connection.execute(text(
        "INSERT INTO shard_reputation (shard_id, node_id, checks, verified_positions, mismatches, disputes, status, "
        "status_since, status_event_id, status_reason, updated_at, first_event_at) VALUES (:shard, :node, 0, 0, 1, 0, "
        "'quarantined', 1, :event, 'evidence', 1, 1)"), dict(shard=shard_id, node=node, event=event_id))
    connection.execute(text(
        "INSERT INTO integrity_evidence (shard_id, event_id, kind, pipeline_id, reported_by, witnesses, layer_lo, "
        "layer_hi, quantization, dtype, position, step_kind, relative_error, tolerance, evidence_sha256, occurred_at) "
        "VALUES (:shard, :event, 'confirmed', 'p', 'hub', '[]', 0, 3, 'none', 'float32', 1, 'decode', 0.4, 0.002, "
        "'ab', 1)"), dict(shard=shard_id, event=event_id))


def test_migration_0016_records_who_quarantined_what_was_held_before_it(tmp_path):
    path = tmp_path / "old.db"
    upgrade_database(path, "0015")
    old = open_engine(path)
    with old.begin() as connection:
        _old_quarantine(connection, B, "node-b", "e-b")
        _old_quarantine(connection, C, "node-c", "e-c")
    old.dispose()
    upgrade_database(path)
    engine = open_engine(path)
    try:
        assert rows(engine) == {B: ("quarantined", 1, "hub"), C: ("quarantined", 1, "hub")}
        apply_all(engine, [LogBuilder().stored(confirmed("p3", D, [A, B], t=3.0))])
        assert rows(engine)[D] == ("ok", 1, None) and kinds(engine)[D] == ["unheld"]
    finally:
        engine.dispose()
