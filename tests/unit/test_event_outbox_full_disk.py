"""The event outbox on a full disk (hearth/events/outbox.py): events the file refuses are still written while the
process runs, said once (not once per event), and kept in order as soon as there is room again, so that none is lost
across a restart; removals the disk refuses are said once too, and the next run writes none of those events twice."""

from __future__ import annotations

import asyncio
import errno
import logging

from hearth.events.outbox import EventOutbox
from hearth.events.outbox_file import OutboxFile
from tests.outbox_brokers import BrokerStoringNothing, RecordingBroker
from tests.unit.test_event_outbox_file import _OutboxLookingInTheRecording, withdrawn


class _BrokerStoringOnceOpened(RecordingBroker):
    """Stores nothing until `opened` is set, then every publish."""

    def __init__(self) -> None:
        super().__init__()
        self.opened = asyncio.Event()

    async def publish(self, subject, payload, timeout, headers):
        await self.opened.wait()
        await super().publish(subject, payload, timeout, headers)


class _FileOnADisk(OutboxFile):
    """An outbox file whose disk may be full: every write refused then with ENOSPC, as the filesystem says it."""

    full = False

    def _refuse_when_full(self) -> None:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    def append(self, event):
        self._refuse_when_full()
        return super().append(event)

    def append_many(self, events):
        self._refuse_when_full()
        return super().append_many(events)

    def remove(self, row_id):
        self._refuse_when_full()
        return super().remove(row_id)


async def claim(folder, kind=OutboxFile):
    return await asyncio.to_thread(kind.claim, folder, "orch")


def outbox_lines(caplog, level):
    return [record.getMessage() for record in caplog.records
            if record.name == "hearth.events.outbox" and record.levelno == level]


async def test_events_the_full_disk_refused_are_said_once_and_kept_in_order_once_there_is_room(tmp_path, caplog):
    outbox = EventOutbox(BrokerStoringNothing(), max_queued=100, retry_wait_s=0.01)
    file = await claim(tmp_path, _FileOnADisk)
    outbox.start(file)
    recorded = [withdrawn(f"s{number}") for number in range(30)]
    with caplog.at_level(logging.INFO, logger="hearth.events.outbox"):
        file.full = True
        for event in recorded[:-1]:
            await outbox.record(event)
        file.full = False
        await outbox.record(recorded[-1])
        await outbox.stop(timeout_s=0.05)

    errors = outbox_lines(caplog, logging.ERROR)
    assert len(errors) == 2, errors  # the refusal, once; the shutdown's count
    assert f"{file.path}: disk full" in errors[0]
    assert "30 kept in" in errors[1] and "lost" not in errors[1]
    assert any("keeping events again (29 recorded while it could not" in line
               for line in outbox_lines(caplog, logging.WARNING))
    reopened = await claim(tmp_path)
    assert [left.event.event_id for left in reopened.left] == [event.event_id for event in recorded]
    reopened.close()


async def test_a_stop_while_the_disk_is_still_full_says_how_many_events_are_lost(tmp_path, caplog):
    outbox = EventOutbox(BrokerStoringNothing(), max_queued=100, retry_wait_s=0.01)
    file = await claim(tmp_path, _FileOnADisk)
    outbox.start(file)
    await outbox.record(withdrawn("kept"))
    file.full = True
    for number in range(3):
        await outbox.record(withdrawn(f"refused{number}"))
    with caplog.at_level(logging.ERROR, logger="hearth.events.outbox"):
        await outbox.stop(timeout_s=0.05)

    assert "4 audit event(s) not written before shutdown; 1 kept in" in caplog.text
    assert "3 lost: the file refused them (disk full" in caplog.text


async def test_events_stored_while_the_disk_was_full_are_not_kept_afterwards(tmp_path):
    broker = RecordingBroker()
    outbox = EventOutbox(broker, max_queued=100, retry_wait_s=0.01)
    file = await claim(tmp_path, _FileOnADisk)
    outbox.start(file)
    file.full = True
    recorded = [withdrawn(f"s{number}") for number in range(10)]
    for event in recorded:
        await outbox.record(event)
    assert await outbox.flush(timeout_s=5)
    file.full = False
    await outbox.stop(timeout_s=1)

    assert broker.msg_ids == [event.event_id for event in recorded]
    reopened = await claim(tmp_path)
    assert reopened.left == []
    reopened.close()


async def test_removals_the_full_disk_refused_are_said_once_and_the_next_run_writes_none_twice(tmp_path, caplog):
    broker = _BrokerStoringOnceOpened()
    outbox = EventOutbox(broker, max_queued=100, retry_wait_s=0.01)
    file = await claim(tmp_path, _FileOnADisk)
    outbox.start(file)
    recorded = [withdrawn(f"s{number}") for number in range(10)]
    with caplog.at_level(logging.INFO, logger="hearth.events.outbox"):
        for event in recorded:
            await outbox.record(event)
        file.full = True  # each appended, then the disk fills before their removal
        broker.opened.set()
        assert await outbox.flush(timeout_s=5)
        await outbox.stop(timeout_s=1)
    file.full = False

    assert len(outbox_lines(caplog, logging.ERROR)) == 1
    assert "events stored stay in it until there is room" in outbox_lines(caplog, logging.ERROR)[0]
    left_in_the_file = await claim(tmp_path)
    assert left_in_the_file.count() == 10
    left_in_the_file.close()
    restarted = _OutboxLookingInTheRecording(broker, max_queued=100, retry_wait_s=0.01)
    restarted.start(await claim(tmp_path))
    assert await restarted.flush(timeout_s=5)
    await restarted.stop(timeout_s=1)
    assert broker.msg_ids == [event.event_id for event in recorded]


async def test_a_file_capped_by_sqlite_says_disk_full_too(tmp_path, caplog):
    """SQLite's own word for a full disk (SQLITE_FULL, "database or disk is full"), here from a page cap."""
    outbox = EventOutbox(BrokerStoringNothing(), max_queued=2000, retry_wait_s=0.01)
    file = await claim(tmp_path)
    outbox.start(file)
    pages = file._connection.execute("PRAGMA page_count").fetchone()[0]
    file._connection.execute(f"PRAGMA max_page_count = {pages}")
    with caplog.at_level(logging.ERROR, logger="hearth.events.outbox"):
        for number in range(200):
            await outbox.record(withdrawn(f"s{number}"))
    lines = outbox_lines(caplog, logging.ERROR)
    assert len(lines) == 1 and "disk full (database or disk is full)" in lines[0], lines
    await outbox.stop(timeout_s=0.05)


class _FileOnAHungDisk(_FileOnADisk):
    """A full disk that, at the last try before shutdown, stops answering: the append waits until `answer` is set."""

    hung = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        import threading

        self.answer = threading.Event()

    def append(self, event):
        if self.hung:
            self.answer.wait(timeout=30)
        return super().append(event)


async def test_stop_waits_for_a_disk_that_does_not_answer_no_longer_than_an_append(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr("hearth.events.outbox.append_wait_s", 0.2)
    outbox = EventOutbox(BrokerStoringNothing(), max_queued=100, retry_wait_s=0.01)
    file = await claim(tmp_path, _FileOnAHungDisk)
    outbox.start(file)
    file.full = True
    for number in range(3):
        await outbox.record(withdrawn(f"s{number}"))
    file.full, file.hung = False, True
    try:
        with caplog.at_level(logging.INFO, logger="hearth.events.outbox"):
            await asyncio.wait_for(outbox.stop(timeout_s=0.05), timeout=10)
        assert any("3 lost" in line for line in outbox_lines(caplog, logging.ERROR)), caplog.text
    finally:
        file.answer.set()  # the file thread's wait ends, so that it and the file close
