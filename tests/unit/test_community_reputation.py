"""`hearth community` and reputation: the listing, quarantined shards beside their members (whose nodes they hold),
and a steward's clearing (signed with the system key, accepted by a community's projector, refused with nothing
published when the shard is not quarantined; the node stays held while another of its shards is quarantined)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from typer.testing import CliRunner

from hearth.events.signing import EventVerifier
from hearth.readmodels.reputation import ReputationLog
from hearth.services import community_reputation
from hearth.services.community_cli import community_app
from hearth.services.community_reputation import NotQuarantined, ReadModelMissing, clear_quarantine, read_reputation
from tests.readmodel_helpers import LogBuilder, advertised, apply_all, migrated_engine
from tests.reputation_events import confirmed, disputed, verified
from hearth.trust.community import Community

A, B, C = (advertised(0, 3, node).shard_id for node in ("kitchen-pc", "attic-pc", "garage-pc"))


@pytest.fixture
def community(tmp_path):
    community = Community.init(tmp_path / "community", "elm-street")
    for name in ("kitchen-pc", "attic-pc", "hub"):
        community.add(name, "orchestrator" if name == "hub" else "shard")
    return community


@pytest.fixture
def read_model(tmp_path):
    path = tmp_path / "readmodel.sqlite"
    engine = migrated_engine(path)
    log = LogBuilder()
    apply_all(engine, [log.stored(e) for e in (verified("p1", {A: (2, 30), B: (3, 33)}), disputed("p2", [B, C]),
                                               confirmed("p3", A, [B, C]))])
    engine.dispose()
    return path


def test_the_reputation_listing_shows_quarantined_shards_first_with_their_evidence(read_model):
    result = CliRunner().invoke(community_app, ["reputation", "--db", str(read_model)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == ("3 shards with verification outcomes, 1 quarantined; nodes held (none of their shards is "
                        "routed): kitchen-pc")
    assert lines[1].startswith("QUARANTINED kitchen-pc") and A in lines[1] and "mismatches 1" in lines[1]
    assert "relative error 0.42 > tolerance 0.002" in lines[2] and "pipeline p3" in lines[2]
    assert any(B in line and "disputes 1" in line and "checks 3, verified positions 33" in line for line in lines)


def test_the_member_list_marks_members_whose_shards_are_quarantined(community, read_model):
    result = CliRunner().invoke(community_app, ["list", "--dir", str(community.directory), "--db", str(read_model)])
    assert result.exit_code == 0, result.output
    by_member = {line.split()[0]: line for line in result.output.splitlines()[1:]}
    assert by_member["kitchen-pc"].endswith(f"node held, none of its shards routed; QUARANTINED: {A}")
    assert "QUARANTINED" not in by_member["attic-pc"] and "QUARANTINED" not in by_member["hub"]
    without_db = CliRunner().invoke(community_app, ["list", "--dir", str(community.directory),
                                                    "--db", str(read_model.parent / "absent.sqlite")])
    assert without_db.exit_code == 0 and "QUARANTINED" not in without_db.output


def test_a_clearing_is_signed_by_the_steward_and_a_community_projector_applies_it(community, read_model):
    published = []

    async def publish(event) -> None:
        published.append(event)

    event = asyncio.run(clear_quarantine(A, "replaced the faulty GPU", db=read_model,
                                         steward_key=community.system_key(), publish=publish))
    assert published == [event]
    assert (event.shard_id, event.node_id, event.reason) == (A, "system", "replaced the faulty GPU")
    assert event.pipeline_id.startswith("clear-")
    verifier = EventVerifier(community.roster(), max_clock_skew_s=30)
    assert verifier.rejection(event, received_at=event.occurred_at + timedelta(seconds=1)) is None
    log = ReputationLog()
    log.apply(confirmed("p3", A, [B, C], t=-60.0))
    log.apply(event)
    assert log.reputation(A)["status"] == "ok"


def test_an_orchestrator_may_not_clear_a_quarantine(community, read_model):
    async def publish(event) -> None:
        pass

    hub_key = community.directory / "keys" / "hub.nk"
    from hearth.trust.keys import MemberKey

    event = asyncio.run(clear_quarantine(A, "trust me", db=read_model, steward_key=MemberKey.load(hub_key),
                                         publish=publish))
    verifier = EventVerifier(community.roster(), max_clock_skew_s=30)
    # Signed by the hub but claiming the steward's node: refused before it could lift anything.
    assert verifier.rejection(event, received_at=event.occurred_at) == "role_may_not_emit"


def test_clearing_a_shard_that_is_not_quarantined_publishes_nothing(community, read_model):
    published = []

    async def publish(event) -> None:
        published.append(event)

    for shard, state in ((B, "status ok"), ("tiny/m:0-3@nobody", "never checked")):
        with pytest.raises(NotQuarantined, match=state):
            asyncio.run(clear_quarantine(shard, "why not", db=read_model, steward_key=community.system_key(),
                                         publish=publish))
    with pytest.raises(ReadModelMissing, match="no read model"):
        asyncio.run(clear_quarantine(A, "x", db=read_model.parent / "absent.sqlite",
                                     steward_key=community.system_key(), publish=publish))
    assert published == []
    result = CliRunner().invoke(community_app, ["clear-quarantine", B, "--reason", "why not", "--dir",
                                                str(community.directory), "--db", str(read_model)])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"hearth community clear-quarantine: shard {B} is not quarantined in {read_model} (status ok); "
        "nothing was published"]


def test_the_clear_command_publishes_through_the_steward_publisher(community, read_model, monkeypatch):
    published = []

    def fake_publisher(nats, system_key):
        assert system_key == community.system_key_path

        async def publish(event) -> None:
            published.append(event)
        return publish

    monkeypatch.setattr(community_reputation, "steward_publisher", fake_publisher)
    result = CliRunner().invoke(community_app, ["clear-quarantine", A, "--reason", "new GPU", "--dir",
                                                str(community.directory), "--db", str(read_model)])
    assert result.exit_code == 0, result.output
    [event] = published
    assert event.signer == community.system_key().public_key and event.reason == "new GPU"
    assert f"cleared the quarantine of {A} (event {event.event_id}" in result.output
    assert [row.status for row in read_reputation(read_model) if row.shard_id == A] == ["quarantined"]


def test_a_sibling_of_a_quarantined_shard_is_listed_as_held_and_clearing_one_of_two_leaves_the_node_held(
        community, read_model, monkeypatch):
    sibling, second = advertised(0, 2, "kitchen-pc").shard_id, advertised(4, 7, "kitchen-pc").shard_id
    engine = migrated_engine(read_model)
    log = LogBuilder()
    for _ in range(3):  # the fixture's three outcomes came first
        log.stored(verified("p0", {}))
    apply_all(engine, [log.stored(verified("p4", {sibling: (1, 5)})), log.stored(confirmed("p5", second, [B, C]))])
    engine.dispose()
    listing = CliRunner().invoke(community_app, ["reputation", "--db", str(read_model)]).output.splitlines()
    [row] = [index for index, line in enumerate(listing) if sibling in line]
    assert listing[row].startswith("ok") and listing[row + 1].strip() == (
        f"not routed: node kitchen-pc quarantined (shard {A} mismatched)")
    published = []

    def fake_publisher(nats, system_key):
        async def publish(event) -> None:
            published.append(event)
        return publish

    monkeypatch.setattr(community_reputation, "steward_publisher", fake_publisher)
    result = CliRunner().invoke(community_app, ["clear-quarantine", A, "--reason", "new GPU", "--dir",
                                                str(community.directory), "--db", str(read_model)])
    assert result.exit_code == 0, result.output
    assert f"node kitchen-pc stays held (no shard of it is routed) while {second} is quarantined" in result.output


def test_every_other_integrity_event_stays_the_orchestrators(community):
    from hearth.events.signing import emitting_role, sign_event
    from hearth.trust.keys import MemberKey

    assert emitting_role("integrity.quarantine_cleared") == "system"
    assert emitting_role("integrity.mismatch_confirmed") == emitting_role("integrity.shards_verified") == "orchestrator"
    assert emitting_role("shard.advertised") == "shard" and emitting_role("nonsense.kind") is None
    verifier = EventVerifier(community.roster(), max_clock_skew_s=30)
    blame = confirmed("p3", A, [B, C], t=0.0)
    hub = MemberKey.load(community.directory / "keys" / "hub.nk")
    assert verifier.rejection(sign_event(blame, hub), received_at=blame.occurred_at) is None
    as_steward = sign_event(blame.model_copy(update={"node_id": "system"}), community.system_key())
    assert verifier.rejection(as_steward, received_at=blame.occurred_at) == "role_may_not_emit"


def test_the_listing_counts_accusations_past_their_reporters_bound(tmp_path):
    d = advertised(0, 3, "shed-pc").shard_id
    path = tmp_path / "readmodel.sqlite"
    engine = migrated_engine(path)
    log = LogBuilder()
    apply_all(engine, [log.stored(e) for e in (confirmed("p1", A, [B, C], t=1.0), confirmed("p2", B, [A, C], t=2.0),
                                               confirmed("p3", d, [A, B], t=3.0))])
    engine.dispose()
    lines = CliRunner().invoke(community_app, ["reputation", "--db", str(path)]).output.splitlines()
    at = next(n for n, line in enumerate(lines) if d in line)
    assert lines[at].startswith("ok") and "mismatches 1" in lines[at]
    assert lines[at + 1].strip() == ("1 confirmed mismatches quarantined nobody: their reporter's checks already held "
                                     "2 nodes; read them with hearth-replay shard")


def test_a_file_that_is_no_database_given_as_the_read_model_is_one_line(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a database")
    result = CliRunner().invoke(community_app, ["reputation", "--db", str(notes)])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert result.output.strip().splitlines() == [
        f"hearth community reputation: {notes} is not a hearth read model (file is not a database)"]
