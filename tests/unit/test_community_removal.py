"""`hearth community remove` publishes the removal on each stream before the roster changes and records where it
went; with no stream to take it, it changes nothing unless told `--offline`."""

from __future__ import annotations

import asyncio
import socket
from datetime import datetime, timezone

import pytest
from typer.testing import CliRunner

from hearth.events.signing import EventVerifier, StreamPosition
from hearth.events.streams import ALL_STREAMS, MEMBER_REMOVAL_SUBJECTS, PIPELINES_STREAM, SHARDS_STREAM
from hearth.services.cli import app
from hearth.services.community_removal import RemovalNotPublished, publish_removal
from hearth.services.gateway.keys import ApiKeyring, create_api_key
from hearth.trust.community import Community
from hearth.trust.roster import RemovalCut, Roster


@pytest.fixture
def community(tmp_path) -> Community:
    community = Community.init(tmp_path / "community", "elm-street")
    community.add("attic", "shard")
    return community


STORED_AT = datetime(2026, 12, 5, 10, 0, tzinfo=timezone.utc)  # by the broker's clock


class FakeBroker:
    """Stores what is published, one sequence per stream; refuses the streams in `refusing`."""

    def __init__(self, refusing: tuple[str, ...] = ()) -> None:
        self.refusing = refusing
        self.stored: list[tuple[str, int, str, object]] = []

    async def publish(self, event, subject: str) -> tuple[str, int, datetime]:
        stream = next(name for name, removal_subject in MEMBER_REMOVAL_SUBJECTS.items() if removal_subject == subject)
        if stream in self.refusing:
            raise TimeoutError("nats: timeout")
        seq = 40 + len(self.stored)
        self.stored.append((stream, seq, subject, event))
        return stream, seq, STORED_AT


def test_the_removal_goes_on_every_stream_signed_by_the_steward_and_the_cuts_say_where(community):
    broker = FakeBroker()
    attic = community.roster().by_name("attic")
    published = asyncio.run(publish_removal(attic, community.system_key(), broker.publish))
    assert [(cut.stream, cut.seq, cut.stored_at) for cut in published.cuts] == [
        (stream, 40 + n, STORED_AT) for n, stream in enumerate(ALL_STREAMS)]
    assert published.failures == {}
    verifier = EventVerifier(community.roster(), max_clock_skew_s=30)
    for (stream, seq, _subject, event), cut in zip(broker.stored, published.cuts):
        assert (event.type, event.member, event.public_key, event.stream) == (
            "member.removed", "attic", attic.public_key, stream)
        assert cut.event_id == event.event_id
        assert verifier.rejection(event, received_at=event.occurred_at, position=StreamPosition(stream, seq)) is None


def test_a_stream_that_refuses_it_is_reported_and_none_taking_it_is_an_error(community):
    attic = community.roster().by_name("attic")
    published = asyncio.run(publish_removal(attic, community.system_key(), FakeBroker((PIPELINES_STREAM,)).publish))
    assert [cut.stream for cut in published.cuts] == [SHARDS_STREAM]
    assert published.failures == {PIPELINES_STREAM: "nats: timeout"}
    with pytest.raises(RemovalNotPublished, match="no event stream took the removal"):
        asyncio.run(publish_removal(attic, community.system_key(), FakeBroker(ALL_STREAMS).publish))


def test_the_roster_keeps_the_cuts_and_an_older_removal_without_them_still_reads(community):
    cuts = [RemovalCut(stream=SHARDS_STREAM, seq=7, event_id="e1")]
    removed, _ = community.remove("attic", cuts=cuts)
    assert Roster.load(community.roster_path).removed[0].cuts == cuts == removed.cuts
    document = community.roster().model_dump(mode="json")
    del document["removed"][0]["cuts"]
    assert Roster.model_validate(document).removed[0].cuts == []


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_remove_with_no_broker_to_take_the_removal_changes_nothing_unless_offline(community, monkeypatch):
    monkeypatch.setenv("HEARTH_NATS__CONNECT_TIMEOUT_S", "0.5")
    directory = str(community.directory)
    create_api_key(community.directory, "attic")
    refused = CliRunner().invoke(app, ["community", "remove", "--name", "attic", "--dir", directory,
                                       "--nats", f"nats://127.0.0.1:{unused_port()}"])
    assert refused.exit_code == 1, refused.output
    assert "cannot reach NATS" in refused.output and "nothing was changed" in refused.output
    assert community.roster().by_name("attic") is not None and ApiKeyring.load(community.directory).members
    # Without the system key there is no removal event to sign.
    community.system_key_path.rename(community.directory / "elsewhere.nk")
    refused = CliRunner().invoke(app, ["community", "remove", "--name", "attic", "--dir", directory])
    assert refused.exit_code == 1 and "only the steward" in refused.output
    assert community.roster().by_name("attic") is not None
    removed = CliRunner().invoke(app, ["community", "remove", "--name", "attic", "--dir", directory, "--offline"])
    assert removed.exit_code == 0, removed.output
    assert "no removal event published (--offline)" in removed.output
    assert community.roster().removed[0].cuts == []
