"""The event outbox's file (hearth/events/outbox_file.py, used by hearth/events/outbox.py): `record` keeps each event
in it until stored, the next process writes what was left first, in order and with the same ids; one process per
file; the file holds no more than `max_queued` recorded events; a file that is not a database is moved aside."""

from __future__ import annotations

import asyncio
import json

import pytest

from hearth.events.models import ShardWithdrawn
from hearth.events.outbox import EventOutbox
from hearth.events.outbox_file import OutboxFile, file_stem
from tests.outbox_brokers import BrokerStoringNothing, RecordingBroker


class _OutboxLookingInTheRecording(EventOutbox):
    """Looks for an event in what the recording broker stored, and notes which events it looked for."""

    def __init__(self, broker: RecordingBroker, **kwargs) -> None:
        super().__init__(broker, **kwargs)
        self.looked_for: list[str] = []

    async def _stored_already(self, event) -> bool:
        self.looked_for.append(event.event_id)
        return event.event_id in self.js.msg_ids


def withdrawn(shard_id: str) -> ShardWithdrawn:
    return ShardWithdrawn(node_id="n", shard_id=shard_id, reason="shutdown")


async def claim(folder, owner="orch") -> OutboxFile:
    return await asyncio.to_thread(OutboxFile.claim, folder, owner)


async def test_what_one_process_left_in_its_file_is_written_first_by_the_next_in_order_with_the_same_ids(tmp_path):
    ended = EventOutbox(BrokerStoringNothing(), max_queued=8, retry_wait_s=0.01)
    ended.start(await claim(tmp_path))
    left = [withdrawn(f"s{number}") for number in range(3)]
    for event in left:
        await ended.record(event)
    await ended.stop(timeout_s=0.05)

    broker = RecordingBroker()
    restarted = _OutboxLookingInTheRecording(broker, max_queued=8, retry_wait_s=0.01)
    file = await claim(tmp_path)
    assert file.path == ended.file.path
    restarted.start(file)
    later = withdrawn("s-later")
    await restarted.record(later)
    assert await restarted.flush(timeout_s=5)
    await restarted.stop(timeout_s=1)

    assert broker.msg_ids == [event.event_id for event in [*left, later]]
    # The oldest is looked for; not stored, so none after it was ever tried (one event at a time, in order).
    assert restarted.looked_for == [left[0].event_id]
    reopened = await claim(tmp_path)
    assert (reopened.left, reopened.count()) == ([], 0)
    reopened.close()


async def test_events_stored_by_the_previous_process_and_left_in_its_file_are_looked_for_and_not_written_again(
        tmp_path):
    """The kill came after the acks of the two oldest and before their removal from the file."""
    ended = EventOutbox(BrokerStoringNothing(), max_queued=8, retry_wait_s=0.01)
    ended.start(await claim(tmp_path))
    left = [withdrawn(f"s{number}") for number in range(4)]
    for event in left:
        await ended.record(event)
    await ended.stop(timeout_s=0.05)

    broker = RecordingBroker()
    broker.msg_ids = [left[0].event_id, left[1].event_id]
    restarted = _OutboxLookingInTheRecording(broker, max_queued=8, retry_wait_s=0.01)
    restarted.start(await claim(tmp_path))
    assert await restarted.flush(timeout_s=5)
    await restarted.stop(timeout_s=1)

    assert broker.msg_ids == [event.event_id for event in left]
    assert restarted.looked_for == [event.event_id for event in left[:3]]


async def test_record_returns_with_the_event_in_the_file(tmp_path):
    outbox = EventOutbox(BrokerStoringNothing(), max_queued=8, retry_wait_s=0.01)
    outbox.start(await claim(tmp_path))
    event = withdrawn("s1")
    await outbox.record(event)

    assert await asyncio.to_thread(outbox.file.count) == 1
    await outbox.stop(timeout_s=0.05)


async def test_two_processes_of_one_owner_never_share_a_file_and_a_released_one_is_claimed_again(tmp_path):
    first = await claim(tmp_path)
    second = await claim(tmp_path)
    assert first.path != second.path
    assert first.path.name == "orch.sqlite"
    first.close()

    again = await claim(tmp_path)
    assert again.path == first.path
    for file in (second, again):
        file.close()


async def test_the_file_holds_at_most_max_queued_recorded_events(tmp_path):
    outbox = EventOutbox(BrokerStoringNothing(), max_queued=2, retry_wait_s=0.01)
    outbox.start(await claim(tmp_path))
    for shard_id in ("s1", "s2"):
        await outbox.record(withdrawn(shard_id))

    with pytest.raises(TimeoutError):
        await asyncio.wait_for(outbox.record(withdrawn("s3")), timeout=0.2)
    assert await asyncio.to_thread(outbox.file.count) == 2
    await outbox.stop(timeout_s=0.05)


async def test_what_a_previous_run_left_takes_its_room_so_kills_while_the_broker_is_down_never_grow_the_file(
        tmp_path):
    for run in range(2):
        outbox = EventOutbox(BrokerStoringNothing(), max_queued=2, retry_wait_s=0.01)
        outbox.start(await claim(tmp_path))
        if run == 0:
            for shard_id in ("s1", "s2"):
                await outbox.record(withdrawn(shard_id))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(outbox.record(withdrawn(f"s-run-{run}")), timeout=0.2)
        assert await asyncio.to_thread(outbox.file.count) == 2
        await outbox.stop(timeout_s=0.05)


async def test_a_file_that_is_not_a_database_is_moved_aside_and_a_fresh_one_started(tmp_path):
    (tmp_path / "orch.sqlite").write_bytes(b"not a database, " * 100)
    file = await claim(tmp_path)

    assert (file.left, file.count()) == ([], 0)
    assert [path.read_bytes()[:16] for path in tmp_path.glob("orch.sqlite.unreadable-*")] == [b"not a database, "]
    file.close()


async def test_a_row_that_is_not_an_event_is_dropped_and_the_rest_written(tmp_path):
    file = await claim(tmp_path)
    kept = withdrawn("s1")
    file.append(kept)
    file._connection.execute("INSERT INTO events (event) VALUES (?)", (json.dumps({"type": "not a type"}).encode(),))
    file.close()

    reopened = await claim(tmp_path)
    assert [left.event.event_id for left in reopened.left] == [kept.event_id]
    assert reopened.count() == 1
    reopened.close()


async def test_a_newer_hearths_event_left_in_the_file_is_kept_unwritten_for_the_newer_hearth(tmp_path, caplog):
    # The member ran a newer hearth on this file, then went back to this one: the newer one's events are not this
    # hearth's to write, nor to drop.
    file = await claim(tmp_path)
    written_by_this_hearth = withdrawn("s1")
    file.append(written_by_this_hearth)
    newer = {**json.loads(withdrawn("s2").model_dump_json()), "type": "shard.rebalanced"}
    file._connection.execute("INSERT INTO events (event) VALUES (?)", (json.dumps(newer).encode(),))
    file.close()

    broker = RecordingBroker()
    older = _OutboxLookingInTheRecording(broker, max_queued=8, retry_wait_s=0.01)
    older.start(await claim(tmp_path))
    assert await older.flush(timeout_s=5)
    await older.stop(timeout_s=1)
    assert broker.msg_ids == [written_by_this_hearth.event_id]
    assert older.file.kept_for_a_newer_hearth == 1
    assert any("shard.rebalanced" in record.getMessage() and "newer hearth" in record.getMessage()
               for record in caplog.records)

    reopened = await claim(tmp_path)  # what the newer hearth finds when it runs on the file again
    assert reopened.count() == 1 and reopened.kept_for_a_newer_hearth == 1
    assert [json.loads(data)["type"] for (data,) in reopened._connection.execute("SELECT event FROM events")] == \
        ["shard.rebalanced"]
    reopened.close()


def test_an_owner_that_is_no_plain_file_name_is_named_by_its_digest():
    assert file_stem("hub-1") == "hub-1"
    assert file_stem("../etc/passwd").startswith("node-")
    assert "/" not in file_stem("a/b")
