"""Kept-prefix records in a signed community are their signer's: a member that copies another member's marks from the
log into a `pipeline.completed` of its own, naming hops of its choice, neither replaces nor shadows that member's
record, so routing for the member that kept the blocks still finds its own chain; and a rebuild keeps the same rows."""

from __future__ import annotations

import pytest
from alembic import command
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from hearth.events.consume import StoredEvent
from hearth.events.models import KeptHop, KeptMark, KeptPrefix, PipelineCompleted, encode_event
from hearth.events.signing import EventVerifier, sign_event
from hearth.events.streams import PIPELINES_STREAM, SHARDS_STREAM, seconds_per_day
from hearth.protocol.subjects import event_subject, shard_control_subject, shard_id_for
from hearth.readmodels.db import alembic_config, open_engine, upgrade_database
from hearth.readmodels.positions import PROJECTION_NAME
from hearth.readmodels.projection import ReadModelProjection
from hearth.readmodels.queries import kept_chain_holding
from hearth.readmodels.retention import prune_all, retention_policy
from hearth.services.common.config import HearthSettings, ReadModelSettings
from hearth.services.common.config_processes import PrefixCacheSettings
from hearth.trust.keys import MemberKey
from hearth.trust.roster import new_member, new_roster
from tests.readmodel_helpers import (
    MODEL_ID,
    LogBuilder,
    advertised,
    apply_all,
    at,
    dump_rows,
    heartbeat,
    migrated_engine,
)
from tests.unit.test_kept_prefix_records import PROMPT, completed_call_on, planned

DAY = seconds_per_day
SETTINGS = HearthSettings(prefix_cache=PrefixCacheSettings(enabled=True, block_tokens=4))
KEYS = {name: MemberKey.generate() for name in ("hub-a", "hub-b", "far", "near", "bait")}
ROLES = {"hub-a": "orchestrator", "hub-b": "orchestrator", "far": "shard", "near": "shard", "bait": "shard"}


def verifier() -> EventVerifier:
    roster = new_roster("test")
    for name, key in KEYS.items():
        roster = roster.with_member(new_member(name, ROLES[name], key.public_key))
    return EventVerifier(roster, max_clock_skew_s=30)


class SignedLog:
    """Events signed by their node's member key, stored as a projector reads them (the body as published)."""

    def __init__(self) -> None:
        self.messages: list[StoredEvent] = []
        self._seqs = {SHARDS_STREAM: 0, PIPELINES_STREAM: 0}

    def add(self, event, *, stored_at: float | None = None) -> StoredEvent:
        """Sign and store `event`; the broker stores it at `stored_at` (s after T0), by default when it occurred."""
        signed = sign_event(event, KEYS[event.node_id])
        stream = SHARDS_STREAM if signed.type.startswith("shard.") else PIPELINES_STREAM
        self._seqs[stream] += 1
        stored = signed.occurred_at if stored_at is None else at(stored_at)
        message = StoredEvent(stream=stream, seq=self._seqs[stream], subject=event_subject(signed),
                              time=stored, headers={}, event=signed, data=encode_event(signed))
        self.messages.append(message)
        return message


def shard_on(node: str, *, hop_weight: float = 1.0):
    shard_id = shard_id_for(MODEL_ID, 0, 7, node)
    return advertised(0, 7, node, control_subject=shard_control_subject(node, shard_id), hop_weight=hop_weight)


def completed_by(node: str, pipeline_id: str, kept: KeptPrefix, t: float) -> PipelineCompleted:
    return PipelineCompleted(pipeline_id=pipeline_id, prompt_tokens=30, completion_tokens=3, duration_ms=40.0,
                             tokens_per_second=50.0, finish_reason="length", node_id=node, occurred_at=at(t),
                             kept_prefix=kept)


def apply_verified(engine, messages) -> None:
    apply_all(engine, messages, ReadModelProjection(verifier=verifier()))


@pytest.fixture
def mesh(tmp_path):
    """A community's read model that knows three replicas of the whole model: `near` the cheapest, `far` and `bait`
    asking to be used last."""
    engine = migrated_engine(tmp_path / "rm.db")
    log = SignedLog()
    far, near, bait = shard_on("far", hop_weight=1.5), shard_on("near"), shard_on("bait", hop_weight=1.5)
    for shard in (far, near, bait):
        log.add(shard)
        log.add(heartbeat(shard.shard_id, node=shard.node_id, decode_step_ms=5.0))
    apply_verified(engine, log.messages)
    yield engine, log, {shard.node_id: shard.shard_id for shard in (far, near, bait)}
    engine.dispose()


async def test_a_member_copying_another_s_marks_does_not_steer_its_calls(mesh, tmp_path):
    engine, log, shards = mesh
    a, b = KEYS["hub-a"], KEYS["hub-b"]
    # hub-a's call kept its blocks on `far`: hub-a's next turn goes there although cost alone picks `near`.
    own = completed_call_on(shards["far"], SETTINGS, a)
    apply_verified(engine, [log.add(completed_by("hub-a", "p-a", own, t=10))])
    assert await planned(engine, SETTINGS, PROMPT, a) == [shards["far"]]
    # hub-b reads the marks off the log and publishes, signed by itself, a completion of its own with the same marks
    # on `bait` (holding nothing), later than hub-a's: it verifies and is applied, yet hub-a still finds its own chain.
    copied = own.model_copy(update={"hops": [KeptHop(shard_id=shards["bait"], layer_lo=0, layer_hi=7)]})
    apply_verified(engine, [log.add(completed_by("hub-b", "p-b", copied, t=11))])
    assert not dump_rows(engine)["rejected_events"]
    assert {row[0] for row in dump_rows(engine)["kept_prefixes"]} == {a.public_key, b.public_key}
    assert await planned(engine, SETTINGS, PROMPT, a) == [shards["far"]]
    # Nor does hub-b's orchestrator find a chain under marks that are not its member's.
    assert await planned(engine, SETTINGS, PROMPT, b) == [shards["near"]]
    # hub-b's copy, alone in the log, draws hub-a nowhere either (no record of hub-a's is shadowed or stood in for).
    alone = migrated_engine(tmp_path / "alone.db")
    apply_verified(alone, [message for message in log.messages if message.event.node_id != "hub-a"])
    assert await planned(alone, SETTINGS, PROMPT, a) == [shards["near"]]
    alone.dispose()


def test_a_record_is_found_only_for_its_signer_s_lookups_and_a_rebuild_keeps_the_same_rows(mesh, tmp_path):
    engine, log, shards = mesh
    a, b = KEYS["hub-a"], KEYS["hub-b"]
    marks = [f"{index:032x}" for index in range(1, 6)]

    def kept_on(node: str, blocks: int) -> KeptPrefix:
        return KeptPrefix(hops=[KeptHop(shard_id=shards[node], layer_lo=0, layer_hi=7)],
                          marks=[KeptMark(blocks=blocks, name=marks[blocks - 1])], idle_s=600)

    live = [log.add(completed_by("hub-a", "p-a", kept_on("far", 3), t=10)),
            log.add(completed_by("hub-b", "p-b", kept_on("bait", 3), t=11)),
            log.add(completed_by("hub-b", "p-b2", kept_on("bait", 5), t=12))]
    for message in live:  # one event at a time, as the live projector may
        apply_verified(engine, [message])
    now_s = at(20).timestamp()
    with Session(engine) as session:
        by_a = kept_chain_holding(session, marks, now_s, a.public_key)
        by_b = kept_chain_holding(session, marks, now_s, b.public_key)
        unsigned = kept_chain_holding(session, marks, now_s, None)
    assert (by_a.hops, by_a.blocks) == (((shards["far"], 0, 7),), 3)
    assert (by_b.hops, by_b.blocks) == (((shards["bait"], 0, 7),), 5)
    assert unsigned is None  # what members signed draws no orchestrator of an open mesh
    # A rebuild (the whole log in one batch) keeps the same rows, signers and all.
    rebuilt = migrated_engine(tmp_path / "rebuilt.db")
    apply_verified(rebuilt, log.messages)
    assert dump_rows(rebuilt) == dump_rows(engine)
    rows = dump_rows(rebuilt)["kept_prefixes"]
    assert sorted((row[0], row[1], row[2]) for row in rows) == sorted(
        [(a.public_key, marks[2], "p-a"), (b.public_key, marks[2], "p-b"), (b.public_key, marks[4], "p-b2")])
    rebuilt.dispose()


def test_a_member_dating_its_records_ahead_hurries_out_only_its_own(mesh, tmp_path):
    engine, log, shards = mesh
    a, b = KEYS["hub-a"], KEYS["hub-b"]
    marks = [f"{index:032x}" for index in range(1, 6)]

    def kept_on(node: str, blocks: int) -> KeptPrefix:
        return KeptPrefix(hops=[KeptHop(shard_id=shards[node], layer_lo=0, layer_hi=7)],
                          marks=[KeptMark(blocks=blocks, name=marks[blocks - 1])], idle_s=60)

    # hub-b's record of t=5 expires at 65, hub-a's of t=10 at 70; hub-b's next, stored at 50, says it was kept at 80,
    # as far ahead as the verifier lets a clock run (30 s).
    records = [log.add(completed_by("hub-b", "p-b", kept_on("bait", 1), t=5)),
               log.add(completed_by("hub-a", "p-a", kept_on("far", 3), t=10)),
               log.add(completed_by("hub-b", "p-b2", kept_on("bait", 2), t=80), stored_at=50)]
    for message in records:
        apply_verified(engine, [message])
    assert not dump_rows(engine)["rejected_events"]
    # hub-a's record has not expired: its next call, a few seconds on, still goes to the chain that holds its blocks.
    with Session(engine) as session:
        by_a = kept_chain_holding(session, marks, at(55).timestamp(), a.public_key)
    assert by_a is not None and (by_a.hops, by_a.blocks) == (((shards["far"], 0, 7),), 3)
    # hub-b's own record that expired before its latest was kept goes, as before.
    assert sorted((row[0], row[1]) for row in dump_rows(engine)["kept_prefixes"]) == sorted(
        [(a.public_key, marks[2]), (b.public_key, marks[1])])
    # The same rows whether the log is applied a record at a time or in one batch (a rebuild).
    rebuilt = migrated_engine(tmp_path / "rebuilt.db")
    apply_verified(rebuilt, log.messages)
    assert dump_rows(rebuilt) == dump_rows(engine)
    rebuilt.dispose()


def test_a_signer_that_keeps_nothing_more_leaves_its_records_until_they_age_out_of_the_log(mesh):
    engine, log, shards = mesh
    a, b = KEYS["hub-a"], KEYS["hub-b"]
    marks = [f"{index:032x}" for index in range(1, 3)]

    def kept_by(node: str, mark: str, t: float):
        kept = KeptPrefix(hops=[KeptHop(shard_id=shards["far"], layer_lo=0, layer_hi=7)],
                          marks=[KeptMark(blocks=1, name=mark)], idle_s=60)
        return log.add(completed_by(node, f"p-{node}-{int(t)}", kept, t=t))

    def signers_left() -> set[str]:
        return {row[0] for row in dump_rows(engine)["kept_prefixes"]}

    def prune() -> None:
        prune_all(sessionmaker(engine), retention_policy(ReadModelSettings()), PROJECTION_NAME)

    # hub-a keeps nothing after t=10; hub-b's later records prune only hub-b's.
    apply_verified(engine, [kept_by("hub-a", marks[0], 10), kept_by("hub-b", marks[1], 20 * DAY)])
    prune()
    assert signers_left() == {a.public_key, b.public_key}  # hub-a's record is still in the log
    # Once the log's clock is a retention past its expiry, the retention prunes it.
    apply_verified(engine, [kept_by("hub-b", marks[1], 31 * DAY)])
    assert signers_left() == {a.public_key, b.public_key}
    prune()
    assert signers_left() == {b.public_key}


def test_on_an_open_mesh_records_are_unsigned_and_found_by_unsigned_lookups(tmp_path):
    engine = migrated_engine(tmp_path / "open.db")
    mark = "ab" * 16
    record = KeptPrefix(hops=[KeptHop(shard_id="m:0-7@far", layer_lo=0, layer_hi=7)],
                        marks=[KeptMark(blocks=1, name=mark)], idle_s=600)
    apply_all(engine, [LogBuilder().stored(completed_by("hub-a", "p1", record, t=10))])
    assert [row[:3] for row in dump_rows(engine)["kept_prefixes"]] == [("", mark, "p1")]
    with Session(engine) as session:
        assert kept_chain_holding(session, [mark], at(20).timestamp(), None).blocks == 1
        assert kept_chain_holding(session, [mark], at(20).timestamp(), KEYS["hub-a"].public_key) is None
    engine.dispose()


def test_records_from_before_signers_were_kept_carry_over_as_unsigned_and_back(tmp_path):
    path = tmp_path / "old.db"
    upgrade_database(path, "0011")
    row = dict(name="cd" * 16, pipeline_id="p1", hops='[["m:0-7@far", 0, 7]]', blocks=2, kept_at=10, expires_at=610)
    insert = "INSERT INTO kept_prefixes ({0}) VALUES ({1})".format(", ".join(row), ", ".join(f":{k}" for k in row))
    engine = open_engine(path)
    with engine.begin() as connection:
        connection.execute(text(insert), row)
    engine.dispose()
    upgrade_database(path)
    engine = open_engine(path)
    assert dump_rows(engine)["kept_prefixes"] == [("", *row.values())]
    # Down again: one row per name, the latest kept of each.
    with engine.begin() as connection:
        connection.execute(text(insert.replace("(name", "(signer, name").replace("(:name", "(:signer, :name")),
                           dict(row, signer="someone", pipeline_id="p2", kept_at=20))
    engine.dispose()
    command.downgrade(alembic_config(path), "0011")
    engine = open_engine(path)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT name, pipeline_id FROM kept_prefixes")).all() == [(row["name"], "p2")]
    engine.dispose()


def test_records_keyed_by_signer_and_name_carry_over_and_back_to_the_latest_kept(tmp_path):
    path = tmp_path / "old.db"
    upgrade_database(path, "0014")
    columns = "signer, name, pipeline_id, hops, blocks, kept_at, expires_at"
    insert = text(f"INSERT INTO kept_prefixes ({columns}) VALUES (:signer, :name, :pipeline_id, :hops, :blocks, "
                  ":kept_at, :expires_at)")
    held = [dict(signer=signer, name="cd" * 16, pipeline_id=f"p-{signer}", hops='[["m:0-7@far", 0, 7]]', blocks=2,
                 kept_at=10, expires_at=610) for signer in ("", "someone")]
    engine = open_engine(path)
    with engine.begin() as connection:
        connection.execute(insert, held)
    engine.dispose()
    upgrade_database(path)
    engine = open_engine(path)
    assert dump_rows(engine)["kept_prefixes"] == [tuple(row.values()) for row in held]
    # A record of the same name kept earlier sits beside the one held; down again, the latest kept of each stays.
    with engine.begin() as connection:
        connection.execute(insert, dict(held[1], pipeline_id="p-earlier", kept_at=5, expires_at=900))
    assert len(dump_rows(engine)["kept_prefixes"]) == 3
    engine.dispose()
    command.downgrade(alembic_config(path), "0014")
    engine = open_engine(path)
    with engine.connect() as connection:
        assert sorted(connection.execute(text("SELECT signer, pipeline_id FROM kept_prefixes")).all()) == [
            ("", "p-"), ("someone", "p-someone")]
    engine.dispose()
