"""`hearth community publish-pending` puts on each stream what its log lacks of the roster's member changes, after an
`add`, `remove` or `rotate-key` that a stream did not take: only there, in order, never twice, stopping on a stream at
the first change it refuses (a reader must meet them in order), and saying per stream what it published and held;
`list` shows the changes noted as missing until then. An online `remove` or `rotate-key` publishes first what a stream
lacks of its member's earlier changes, so it never overtakes one (a reader with an older roster could not follow). The
real broker's run is tests/integration/test_member_changes_published_later.py."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
from typer.testing import CliRunner

from hearth.events.models import MemberAdded, MemberKeyRotated, MemberRemoved
from hearth.events.streams import ALL_STREAMS, PIPELINES_STREAM, SHARDS_STREAM
from hearth.services import community_addition, community_pending
from hearth.services.cli import app
from hearth.trust.community import Community
from hearth.trust.keys import MemberKey
from tests.unit.test_community_removal import FakeBroker, steward_publishes_to


@pytest.fixture
def community(tmp_path) -> Community:
    community = Community.init(tmp_path / "community", "elm-street")
    community.add("attic", "shard")
    return community


def on(broker: FakeBroker, monkeypatch) -> FakeBroker:
    """`broker` as the streams every steward command here publishes on and reads."""

    @contextlib.asynccontextmanager
    async def as_steward(nats, system_key):
        yield broker

    for module in (community_addition, community_pending):
        monkeypatch.setattr(module, "steward_removal_log", as_steward)
    return steward_publishes_to(broker, monkeypatch)


def hearth(community: Community, *args: str):
    return CliRunner().invoke(app, ["community", *args, "--dir", str(community.directory)])


def said(result) -> str:
    return " ".join(result.output.split())


def stored(broker: FakeBroker) -> Counter:
    """How many events of each (stream, type, member, key) the broker holds."""
    return Counter((stream, event.type, event.member, event.public_key) for stream, _, _, event in broker.stored)


def test_what_a_stream_did_not_take_goes_there_alone_and_never_twice(community, monkeypatch):
    broker = on(FakeBroker(refusing=(PIPELINES_STREAM,)), monkeypatch)
    for change in (["add", "--name", "garage", "--role", "shard"], ["rotate-key", "attic"]):
        assert hearth(community, *change).exit_code == 0
    garage, attic = community.roster().by_name("garage"), community.roster().by_name("attic")
    roster_before = community.roster_path.read_bytes()
    listed = said(hearth(community, "list"))
    assert f"garage: its addition is not in the log of {PIPELINES_STREAM}" in listed
    assert f"attic: its key rotation is not in the log of {PIPELINES_STREAM}" in listed

    broker.refusing = ()
    published = hearth(community, "publish-pending")
    assert published.exit_code == 0, published.output
    assert f"{SHARDS_STREAM}: holds every change of attic, garage" in said(published)
    # attic was in the roster before the log took anything: its addition goes first, under its first key.
    assert [(stream, type(event), event.member) for stream, _, _, event in broker.stored[-3:]] == [
        (PIPELINES_STREAM, MemberAdded, "attic"), (PIPELINES_STREAM, MemberKeyRotated, "attic"),
        (PIPELINES_STREAM, MemberAdded, "garage")]
    assert broker.stored[-3][3].public_key == attic.retired_keys[0].public_key
    assert broker.stored[-2][3].new_public_key == attic.public_key
    assert broker.stored[-1][3].public_key == garage.public_key
    assert max(stored(broker).values()) == 1
    assert community.roster_path.read_bytes() == roster_before  # the roster's cuts stay its word

    again = hearth(community, "publish-pending")
    assert again.exit_code == 0 and "published" not in again.output and max(stored(broker).values()) == 1
    assert "publish-pending" not in hearth(community, "list").output


def test_a_removal_no_stream_took_goes_on_every_stream(community, monkeypatch):
    broker = on(FakeBroker(), monkeypatch)
    assert hearth(community, "remove", "--name", "attic", "--offline").exit_code == 0
    assert "attic: its removal is not in the log" in said(hearth(community, "list"))
    published = hearth(community, "publish-pending", "--name", "attic")
    assert published.exit_code == 0, published.output
    assert [(stream, type(event)) for stream, _, _, event in broker.stored] == [
        (stream, MemberRemoved) for stream in ALL_STREAMS]
    assert "publish-pending" not in hearth(community, "list").output


class RefusingAfter(FakeBroker):
    """Takes `taken` events, then refuses every one on `stream`."""

    def __init__(self, taken: int, stream: str) -> None:
        super().__init__()
        self.taken, self.stream = taken, stream

    async def publish(self, event, subject: str):
        if event.stream == self.stream and sum(stream == self.stream for stream, *_ in self.stored) >= self.taken:
            raise TimeoutError("nats: timeout")
        return await super().publish(event, subject)


def test_a_stream_that_refuses_a_change_gets_none_after_it_until_a_rerun(community, monkeypatch):
    for change in (["add", "--name", "garage", "--role", "shard", "--offline"], ["rotate-key", "attic", "--offline"]):
        assert hearth(community, *change).exit_code == 0
    broker = on(RefusingAfter(1, PIPELINES_STREAM), monkeypatch)
    refused = hearth(community, "publish-pending")
    assert refused.exit_code == 1
    assert f"warning: {PIPELINES_STREAM} did not take the rotation of attic's key" in said(refused)
    assert "1 more wait for it" in said(refused) and "run it again" in said(refused)
    assert [event.type for stream, _, _, event in broker.stored if stream == PIPELINES_STREAM] == ["member.added"]
    assert f"garage: its addition is not in the log of {PIPELINES_STREAM}" in said(hearth(community, "list"))

    broker.taken = 10
    assert hearth(community, "publish-pending").exit_code == 0
    assert [(event.type, event.member) for stream, _, _, event in broker.stored if stream == PIPELINES_STREAM] == [
        ("member.added", "attic"), ("member.key_rotated", "attic"), ("member.added", "garage")]


def test_a_stream_it_cannot_read_gets_nothing(community, monkeypatch):
    broker = on(FakeBroker(unreadable=(PIPELINES_STREAM,)), monkeypatch)
    result = hearth(community, "publish-pending")
    assert result.exit_code == 1 and f"{PIPELINES_STREAM}'s member changes could not be read" in said(result)
    assert {stream for stream, *_ in broker.stored} == {SHARDS_STREAM}


def test_the_stewards_own_rotation_is_said_not_published(community, monkeypatch):
    broker = on(FakeBroker(), monkeypatch)
    assert hearth(community, "rotate-key", "system", "--offline").exit_code == 0
    result = hearth(community, "publish-pending")
    assert result.exit_code == 0
    assert f"{SHARDS_STREAM} lacks the steward's rotation of its own key" in said(result)
    assert all(event.member != "system" for *_, event in broker.stored)


def test_an_unknown_member_or_no_broker_publishes_nothing(community, monkeypatch):
    broker = on(FakeBroker(missing=(PIPELINES_STREAM,)), monkeypatch)
    unknown = hearth(community, "publish-pending", "--name", "nobody")
    assert unknown.exit_code == 1 and "no member named 'nobody'" in unknown.output
    missing = hearth(community, "publish-pending")
    assert missing.exit_code == 1 and "nothing was published" in said(missing) and broker.stored == []


def test_add_of_a_member_the_roster_holds_says_how_to_publish_its_addition(community):
    again = hearth(community, "add", "--name", "attic", "--role", "shard", "--public-key",
                   MemberKey.generate().public_key)
    assert again.exit_code == 1 and "publish-pending --name attic" in said(again)


def test_a_note_that_does_not_read_is_said_by_list_and_replaced_by_the_next_change(community):
    (community.directory / "unpublished.json").write_text("{not json")
    listed = hearth(community, "list")
    assert listed.exit_code == 0 and "the note does not read" in said(listed)
    assert hearth(community, "add", "--name", "garage", "--role", "shard", "--offline").exit_code == 0
    assert "garage: its addition is not in the log" in said(hearth(community, "list"))


def members_log(broker: FakeBroker, stream: str) -> list[tuple[str, str, str]]:
    """What `stream` holds of member changes, in order: type, member and the key each names."""
    return [(event.type, event.member, getattr(event, "new_public_key", event.public_key))
            for stored_in, _, _, event in broker.stored if stored_in == stream]


def test_an_online_rotation_publishes_first_the_earlier_rotation_the_log_lacks(community, monkeypatch):
    broker = on(FakeBroker(), monkeypatch)
    first = community.roster().by_name("attic").public_key
    assert hearth(community, "rotate-key", "attic", "--offline").exit_code == 0
    second = community.roster().by_name("attic").public_key
    rotated = hearth(community, "rotate-key", "attic")
    assert rotated.exit_code == 0, rotated.output
    third = community.roster().by_name("attic").public_key
    for stream in ALL_STREAMS:  # a reader knowing only the first key follows to the third
        assert members_log(broker, stream) == [("member.added", "attic", first),
                                               ("member.key_rotated", "attic", second),
                                               ("member.key_rotated", "attic", third)]
        assert f"{stream}: published the rotation of attic's key to {second}" in said(rotated)
    assert "publish-pending" not in hearth(community, "list").output


def test_an_online_removal_publishes_first_the_addition_the_log_lacks(community, monkeypatch):
    broker = on(FakeBroker(), monkeypatch)
    assert hearth(community, "add", "--name", "garage", "--role", "shard", "--offline").exit_code == 0
    garage = community.roster().by_name("garage").public_key
    assert hearth(community, "remove", "--name", "garage").exit_code == 0
    for stream in ALL_STREAMS:
        assert members_log(broker, stream) == [("member.added", "garage", garage), ("member.removed", "garage", garage)]
    assert "publish-pending" not in hearth(community, "list").output


def test_a_stream_that_refuses_an_earlier_change_gets_nothing_new_and_publish_pending_follows_in_order(
        community, monkeypatch):
    assert hearth(community, "rotate-key", "attic", "--offline").exit_code == 0
    broker = on(RefusingAfter(1, PIPELINES_STREAM), monkeypatch)  # takes attic's addition, not its first rotation
    rotated = hearth(community, "rotate-key", "attic")
    assert rotated.exit_code == 0, rotated.output
    warned = [line for line in rotated.output.splitlines() if PIPELINES_STREAM in line and "warning" in line]
    assert len(warned) == 1 and "the rotation of attic's key" in warned[0] and "nats: timeout" in warned[0]
    assert [event for event, *_ in members_log(broker, PIPELINES_STREAM)] == ["member.added"]
    assert len(members_log(broker, SHARDS_STREAM)) == 3
    attic = community.roster().by_name("attic")
    assert len(attic.retired_keys) == 2  # the roster changes as for a stream that refused the rotation itself
    assert f"attic: its key rotation is not in the log of {PIPELINES_STREAM}" in said(hearth(community, "list"))

    broker.taken = 10
    assert hearth(community, "publish-pending").exit_code == 0
    assert members_log(broker, PIPELINES_STREAM) == members_log(broker, SHARDS_STREAM)
    assert "publish-pending" not in hearth(community, "list").output
