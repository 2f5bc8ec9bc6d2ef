"""`hearth community add` publishes a steward-signed `member.added` on each stream once the roster holds the member,
so other households follow the addition from the log (tests/unit/test_member_added_from_the_log.py), and says so;
a stream that does not take it, or a broker out of reach, is said in one warning line, and the member stays added."""

from __future__ import annotations

import contextlib

import pytest
from typer.testing import CliRunner

from hearth.events.models import MemberAdded
from hearth.events.signing import EventVerifier, StreamPosition
from hearth.events.streams import ALL_STREAMS, MEMBER_REMOVAL_SUBJECTS, PIPELINES_STREAM
from hearth.services import community_addition
from hearth.services.cli import app
from hearth.trust.community import Community
from tests.unit.test_community_removal import FakeBroker, broker_time


@pytest.fixture
def community(tmp_path) -> Community:
    return Community.init(tmp_path / "community", "elm-street")


def steward_publishes_to(broker: FakeBroker, monkeypatch) -> FakeBroker:
    @contextlib.asynccontextmanager
    async def as_steward(nats, system_key):
        yield broker

    monkeypatch.setattr(community_addition, "steward_removal_log", as_steward)
    return broker


def add(community: Community, *extra: str):
    return CliRunner().invoke(app, ["community", "add", "--name", "garage", "--role", "shard", *extra,
                                    "--dir", str(community.directory)])


def test_add_publishes_the_addition_on_every_stream_signed_by_the_steward(community, monkeypatch):
    old_roster = community.roster()  # a household's copy from before the addition
    broker = steward_publishes_to(FakeBroker(), monkeypatch)
    result = add(community)
    assert result.exit_code == 0, result.output
    garage = community.roster().by_name("garage")
    assert [stream for stream, *_ in broker.stored] == list(ALL_STREAMS)
    verifier = EventVerifier(old_roster, max_clock_skew_s=30)
    for stream, seq, subject, event in broker.stored:
        assert isinstance(event, MemberAdded) and subject == MEMBER_REMOVAL_SUBJECTS[stream]
        assert (event.member, event.public_key, event.role, event.trust) == ("garage", garage.public_key, "shard",
                                                                              "trusted")
        assert verifier.rejection(event, received_at=broker_time(event),
                                  position=StreamPosition(stream, seq, subject)) is None
    said = " ".join(result.output.split())
    assert "HEARTH_SHARDS #40, HEARTH_PIPELINES #41" in said and "from the event log" in said
    assert "Give garage's machine the new roster.json" in said and "still recommended" in said


def test_a_stream_that_does_not_take_it_is_said_and_the_member_stays_added(community, monkeypatch):
    steward_publishes_to(FakeBroker(refusing=(PIPELINES_STREAM,)), monkeypatch)
    result = add(community)
    assert result.exit_code == 0, result.output
    assert f"warning: {PIPELINES_STREAM} did not take the addition event" in result.output
    assert community.roster().by_name("garage") is not None


def test_offline_publishes_nothing_and_says_to_hand_the_roster_out(community, monkeypatch):
    broker = steward_publishes_to(FakeBroker(), monkeypatch)
    result = add(community, "--offline")
    assert result.exit_code == 0, result.output
    assert broker.stored == [] and "No stream took its addition" in " ".join(result.output.split())
