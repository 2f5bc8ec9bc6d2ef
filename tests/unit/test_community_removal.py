"""`hearth community remove` publishes the removal on each stream before the roster changes and records where it
went, keeping a removal an earlier run published there rather than publishing a later one; with a stream missing
or none to take it, it changes nothing unless told `--offline`."""

from __future__ import annotations

import asyncio
import socket
from datetime import datetime, timedelta

import pytest
from typer.testing import CliRunner

from hearth.events.consume import StoredEvent
from hearth.events.models import ShardHeartbeat, encode_event
from hearth.events.signing import EventVerifier, StreamPosition, sign_event
from hearth.events.streams import (
    ALL_STREAMS,
    MEMBER_REMOVAL_SUBJECTS,
    PIPELINES_STREAM,
    SHARDS_STREAM,
    StreamsMissing,
)
from hearth.services import community_removal
from hearth.services.cli import app
from hearth.services.community_removal import (
    PublishedRemoval,
    RemovalNotPublished,
    any_removal,
    publish_removal,
    removal_event,
)
from hearth.services.gateway.keys import ApiKeyring, create_api_key
from hearth.trust.community import Community
from hearth.trust.keys import MemberKey
from hearth.trust.roster import RemovalCut, Roster


@pytest.fixture
def community(tmp_path) -> Community:
    community = Community.init(tmp_path / "community", "elm-street")
    community.add("attic", "shard")
    return community


def broker_time(event) -> datetime:
    """When the fake broker stored `event`, by its own clock (a second after the steward signed it)."""
    return event.occurred_at + timedelta(seconds=1)


class FakeBroker:
    """Stores what is published, one sequence per stream; refuses the streams in `refusing`, holds none of those
    in `missing`, and cannot be read on those in `unreadable`."""

    where = "nats://hub:4222"

    def __init__(self, refusing: tuple[str, ...] = (), missing: tuple[str, ...] = (),
                 unreadable: tuple[str, ...] = ()) -> None:
        self.refusing, self.absent, self.unreadable = refusing, missing, unreadable
        self.stored: list[tuple[str, int, str, object]] = []

    async def missing(self, streams) -> list[str]:
        return [stream for stream in streams if stream in self.absent]

    async def removals(self, stream: str) -> list[StoredEvent]:
        if stream in self.unreadable:
            raise TimeoutError("nats: timeout")
        return [StoredEvent(stream=stored_in, seq=seq, subject=subject, time=broker_time(event), headers={},
                            event=event, data=encode_event(event))
                for stored_in, seq, subject, event in self.stored if stored_in == stream]

    async def publish(self, event, subject: str) -> tuple[str, int, datetime]:
        stream = next(name for name, removal_subject in MEMBER_REMOVAL_SUBJECTS.items() if removal_subject == subject)
        if stream in self.refusing:
            raise TimeoutError("nats: timeout")
        seq = 40 + len(self.stored)
        self.stored.append((stream, seq, subject, event))
        return stream, seq, broker_time(event)


def steward_publishes_to(broker: FakeBroker, monkeypatch) -> FakeBroker:
    """`broker` as the streams `hearth community remove` / `rotate-key --nats` publish on, as the steward."""

    async def as_steward(member, steward_key, verifier, nats, system_key, make_event=removal_event,
                         differs=any_removal, earlier=None):
        return await publish_removal(member, steward_key, broker, verifier, make_event=make_event, differs=differs,
                                     earlier=earlier)

    monkeypatch.setattr(community_removal, "publish_removal_as_steward", as_steward)
    return broker


def remove(community: Community, broker: FakeBroker) -> PublishedRemoval:
    """`publish_removal` of attic as `hearth community remove` runs it (the roster as it stands verifies)."""
    verifier = EventVerifier(community.roster(), max_clock_skew_s=30)
    attic = community.roster().by_name("attic")
    return asyncio.run(publish_removal(attic, community.system_key(), broker, verifier))


def test_the_removal_goes_on_every_stream_signed_by_the_steward_and_the_cuts_say_where(community):
    broker = FakeBroker()
    attic = community.roster().by_name("attic")
    published = remove(community, broker)
    assert [(cut.stream, cut.seq, cut.stored_at) for cut in published.cuts] == [
        (stream, 40 + n, broker_time(event)) for n, (stream, *_, event) in enumerate(broker.stored)]
    assert [cut.stream for cut in published.cuts] == list(ALL_STREAMS)
    assert published.failures == {}
    verifier = EventVerifier(community.roster(), max_clock_skew_s=30)
    for (stream, seq, _subject, event), cut in zip(broker.stored, published.cuts):
        assert (event.type, event.member, event.public_key, event.stream) == (
            "member.removed", "attic", attic.public_key, stream)
        assert cut.event_id == event.event_id
        assert verifier.rejection(event, received_at=event.occurred_at, position=StreamPosition(stream, seq)) is None


def test_a_stream_that_refuses_it_is_reported_and_none_taking_it_is_an_error(community):
    published = remove(community, FakeBroker((PIPELINES_STREAM,)))
    assert [cut.stream for cut in published.cuts] == [SHARDS_STREAM]
    assert published.failures == {PIPELINES_STREAM: "nats: timeout"}
    with pytest.raises(RemovalNotPublished, match="no event stream took the removal"):
        remove(community, FakeBroker(ALL_STREAMS))


def test_a_rerun_keeps_the_removal_an_earlier_run_published_and_publishes_only_where_none_is(community):
    """The first run's events went in (its roster write did not, or only one stream took them): a projection cuts
    at the first removal of a key, so the rerun records that one, not a later copy."""
    broker = FakeBroker(refusing=(PIPELINES_STREAM,))
    first = remove(community, broker)
    [first_event] = [event for *_, event in broker.stored]
    broker.refusing = ()
    rerun = remove(community, broker)
    assert rerun.cuts[0] == first.cuts[0] and rerun.cuts[0].stream == SHARDS_STREAM
    assert [(stream, seq) for stream, seq, *_ in broker.stored] == [(SHARDS_STREAM, 40), (PIPELINES_STREAM, 41)]
    assert [cut.stream for cut in rerun.cuts] == list(ALL_STREAMS) and rerun.found == [SHARDS_STREAM]
    assert rerun.found_since == first_event.occurred_at and rerun.failures == {}
    again = remove(community, broker)
    assert again.cuts == rerun.cuts and again.found == list(ALL_STREAMS) and len(broker.stored) == 2


@pytest.mark.parametrize("not_the_removal", ["another member's", "not the steward's", "altered"])
def test_a_rerun_takes_only_the_stewards_removal_of_that_member_for_an_earlier_one(community, not_the_removal):
    eve = community.add("eve", "orchestrator")
    eve_key = MemberKey.load(eve.seed_file)
    attic = community.roster().by_name("attic")
    event = removal_event(attic, SHARDS_STREAM, community.system_key())
    if not_the_removal == "another member's":
        event = removal_event(eve.member, SHARDS_STREAM, community.system_key())
    elif not_the_removal == "not the steward's":
        event = sign_event(event.model_copy(update={"node_id": "eve"}), eve_key)
    else:
        event = event.model_copy(update={"stream": PIPELINES_STREAM})
    broker = FakeBroker()
    broker.stored.append((SHARDS_STREAM, 7, MEMBER_REMOVAL_SUBJECTS[SHARDS_STREAM], event))
    published = remove(community, broker)
    assert published.found == [] and [cut.seq for cut in published.cuts] == [41, 42]


def test_a_missing_stream_changes_nothing_and_an_unreadable_one_is_not_published_blind(community):
    broker = FakeBroker(missing=(PIPELINES_STREAM,))
    with pytest.raises(StreamsMissing, match=f"^the event streams {PIPELINES_STREAM} do not exist on nats://hub:4222; "
                                             "the community's steward creates them: `hearth nats --community DIR`"):
        remove(community, broker)
    assert broker.stored == []
    published = remove(community, FakeBroker(unreadable=(SHARDS_STREAM,)))
    assert [cut.stream for cut in published.cuts] == [PIPELINES_STREAM]
    assert published.failures == {SHARDS_STREAM: "could not read the removals it holds (nats: timeout)"}


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
    community.add("porch", "client")  # a member that calls, so it has API keys
    create_api_key(community.directory, "porch")
    refused = CliRunner().invoke(app, ["community", "remove", "--name", "porch", "--dir", directory,
                                       "--nats", f"nats://127.0.0.1:{unused_port()}"])
    assert refused.exit_code == 1, refused.output
    assert "cannot reach NATS" in refused.output and "nothing was changed" in refused.output
    assert community.roster().by_name("porch") is not None and ApiKeyring.load(community.directory).members
    # Without the system key there is no removal event to sign.
    community.system_key_path.rename(community.directory / "elsewhere.nk")
    refused = CliRunner().invoke(app, ["community", "remove", "--name", "porch", "--dir", directory])
    assert refused.exit_code == 1 and "only the steward" in refused.output
    assert community.roster().by_name("porch") is not None
    removed = CliRunner().invoke(app, ["community", "remove", "--name", "porch", "--dir", directory, "--offline"])
    assert removed.exit_code == 0, removed.output
    assert "no removal event published (--offline)" in removed.output
    assert community.roster().removed[0].cuts == []


def test_a_rerun_leaving_a_stream_without_its_removal_cuts_it_off_there_when_the_roster_changes(community, monkeypatch):
    """On a stream no removal event reached, the roster's time cuts the member off. Until the rerun wrote the roster,
    projections applied what it stored there; a time from the first run would make a rebuild reject that."""
    attic_key = MemberKey.load(community.directory / "keys" / "attic.nk")
    broker = steward_publishes_to(FakeBroker(refusing=(SHARDS_STREAM,)), monkeypatch)
    remove(community, broker)  # the first run: its roster write did not happen
    [(_, _, _, first_event)] = broker.stored
    between = first_event.occurred_at + timedelta(microseconds=1)
    beat = sign_event(ShardHeartbeat(shard_id="m:0-1@attic", queue_depth=0, active_streams=0, p95_latency_ms=1.0,
                                     tokens_served_total=1, node_id="attic", occurred_at=between), attic_key)
    where = StreamPosition(SHARDS_STREAM, 3)
    live = EventVerifier(community.roster(), max_clock_skew_s=30)
    assert live.rejection(beat, received_at=between, position=where) is None

    rerun = CliRunner().invoke(app, ["community", "remove", "--name", "attic", "--dir", str(community.directory),
                                     "--nats", "nats://hub:4222"])
    assert rerun.exit_code == 0, rerun.output
    [gone] = community.roster().removed
    assert [cut.stream for cut in gone.cuts] == [PIPELINES_STREAM]
    rebuilt = EventVerifier(community.roster(), max_clock_skew_s=30)
    assert rebuilt.rejection(beat, received_at=between, position=where) is None
    assert rebuilt.rejection(beat, received_at=datetime.now(gone.removed_at.tzinfo), position=where) == \
        "removed_signer"
