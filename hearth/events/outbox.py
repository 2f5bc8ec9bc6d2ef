"""EventOutbox: takes audit events off a caller's critical path: `record` queues an event, one task writes
the queue to JetStream in order, retrying each event until it is stored.

Why: a JetStream publish waits for the server's fsync (and, across a broker restart, for the broker), and a
call must not stream its tokens at that pace. Nothing is dropped while the process lives: the queue is
bounded (`max_queued`), and a full queue makes `record` wait instead. Its depth is the gauge
`hearth_event_outbox_depth` and `depth`. `stop` writes what is left within its deadline and reports (at
ERROR) any event it could not write before the process ends.

Nothing is stored twice either: a write that failed may have been stored all the same (its ack lost when the
broker went down right after storing it), and the server drops a re-publish of the same `Nats-Msg-Id` only within
the stream's duplicate window, so a retry later than `unchecked_retry_horizon_s` first looks for the event in the
stream.

Nothing is lost when the process is killed either, given a file (`start(file=...)`, hearth/events/outbox_file.py):
`record` returns once the event is appended to it, the writer removes it once JetStream acked it, and the next
process of the same owner writes what was left first, in order, with the same `Nats-Msg-Id`. The oldest of what
was left may have been stored already (the kill came between an ack and the event's removal, which the writer does
not wait for), perhaps longer ago than the duplicate window: they are looked for in the stream, oldest first, until
one is not there. The writer writes one event at a time, in order, so none after that one was ever tried. The
file's reads and writes run on one thread of their own, never on the event loop.

A file the disk refuses (full) keeps nothing new, and the events go on being written from memory: the first refusal is
said once at ERROR ("disk full", naming the file), the later ones not at all, until the file keeps events again
(WARNING). Those it refused and that are not stored yet are appended first, in order, as soon as it takes one again
(at the next `record`, or at `stop`), so the file keeps them for the next run with the order they are written in.
A removal the disk refuses is said the same way: the row stays, and the next run finds its event in the stream.

An event is signed by the member that made it: it is kept in the file signed (by the key of the process that recorded
it), and what a previous run left goes out as it was kept, never signed again. One left signed by a key this process
does not hold (the member's key rotated in between) is dropped, its count said at WARNING: stored now, after that
key's cut, it would be rejected `removed_signer`, and signing it again would vouch for what the retired key signed.
One left unsigned while this process signs (made on an open mesh, or kept by a version that signed only when writing)
is dropped, its count said at ERROR: it has no maker's signature, and this process must not sign it as its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from nats.js import JetStreamContext

from hearth.events.consume import StoredEvent, read_stream
from hearth.events.metrics import event_outbox_depth
from hearth.events.models import EventEnvelope
from hearth.events.outbox_file import LeftEvent, OutboxFile, write_fault
from hearth.events.publish import MSG_ID_HEADER, publish_event, publish_timeout_s, publish_total_deadline_s
from hearth.events.signing import sign_event
from hearth.events.streams import duplicate_window_s, stream_for_subject
from hearth.protocol.subjects import event_subject
from hearth.trust.keys import MemberKey

log = logging.getLogger(__name__)

# Past this long after an event's first write, a retry may come more than the duplicate window after an earlier try
# that was stored (one publish_event call retries up to its deadline plus one timeout): it looks in the stream first.
unchecked_retry_horizon_s = duplicate_window_s - publish_total_deadline_s - publish_timeout_s
# Events the file refused (a full disk) are appended again in transactions of at most this many.
keep_at_once = 256
# `record` waits this long at most for its event's append to the file (a hung disk): the event is written all the same.
append_wait_s = 5.0


@dataclass(eq=False)
class _Queued:
    """An event waiting to be written: the file thread's keeping of it (for `record` to wait on), its row in the
    outbox file once kept (set on the file thread; None without a file or while the disk refuses it), and whether a
    previous process left it (and may have stored it)."""

    event: EventEnvelope
    kept: Future[None] | None = None
    row_id: int | None = None
    left_by_previous_run: bool = False
    holds_room: bool = True  # one of the `max_queued` places, given back once it is stored


class EventOutbox:
    """One ordered, bounded queue of events (kept in a file too, when given one) and the task that writes it."""

    def __init__(self, js: JetStreamContext, *, max_queued: int, retry_wait_s: float,
                 publish_delay_s: float = 0.0, signing_key: MemberKey | None = None,
                 unsendable: asyncio.Event | None = None) -> None:
        self.js = js
        # Set while nothing written can be stored (the broker refuses this process's key at its reconnects: its member
        # removed, or the key rotated): `flush` does not wait then; what waits stays in the file for the next run.
        self.unsendable = unsendable
        # The member key events go out signed by: with a file, on its thread as each is appended (what is kept carries
        # its maker's signature); without, by the writer task, off the caller's path like the write itself.
        self.signing_key = signing_key
        self.retry_wait_s = retry_wait_s
        # Testing only: every write waits this long first, as a slow or distant broker would make it.
        self.publish_delay_s = publish_delay_s
        self._queue: asyncio.Queue[_Queued] = asyncio.Queue()
        # Room for `max_queued` events, recorded or left by a previous run (those take what there is, and more of them
        # are written all the same, first): the file holds at most `max_queued`, or what was left when that was more.
        self.max_queued = max_queued
        self._room = asyncio.Semaphore(max_queued)
        self._writer: asyncio.Task | None = None
        self._writing: _Queued | None = None
        self.file: OutboxFile | None = None
        self._file_thread: ThreadPoolExecutor | None = None
        # Whether the next event a previous run left may have been stored by it: until one is found not stored.
        self._left_maybe_stored = True
        # On the file thread only: events recorded that the file refused (a full disk) and not stored yet, in order;
        # and what the disk refused, said once, while it refuses appends, then removals.
        self._unkept: deque[_Queued] = deque()
        self._append_fault: str | None = None
        self._refused_appends = 0
        self._remove_fault: str | None = None

    @property
    def calls_left_open(self) -> list[str]:
        """The calls (pipeline ids) a killed process of this outbox file began and never recorded the end of, for
        this process to close (hearth/events/outbox_file.py); none without a file."""
        return list(self.file.calls_left_open) if self.file is not None else []

    @property
    def depth(self) -> int:
        """Events recorded and not yet stored (the one being written, and those a previous run left, included)."""
        return self._queue.qsize() + (self._writing is not None)

    def start(self, file: OutboxFile | None = None) -> None:
        """Start the writer; with `file` (claimed by this process), every event is kept in it until stored, and
        what a previous process left in it is written first."""
        if self._writer is not None:
            return
        if file is not None:
            if self.depth:  # what a previous run left goes first, and takes its room before any new event
                raise RuntimeError("an outbox with a file is started before it records")
            self.file = file
            self._file_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="event-outbox-file")
            left_events = self._left_to_write(file)
            holding = min(len(left_events), self.max_queued)
            self._room = asyncio.Semaphore(self.max_queued - holding)
            for number, left in enumerate(left_events):
                self._queue.put_nowait(_Queued(left.event, row_id=left.row_id, left_by_previous_run=True,
                                               holds_room=number < holding))
            if left_events:
                log.warning("event outbox %s: writing %d event(s) a previous run left", file.path, len(left_events))
            event_outbox_depth.set(self.depth)
        self._writer = asyncio.create_task(self._write_forever(), name="event-outbox")

    def _left_to_write(self, file: OutboxFile) -> list[LeftEvent]:
        """What a previous run left, less what this process (which signs) must not send, each removed from the file:
        one left unsigned carries no signature of the member that made it (signing it now would put it under this
        member's name), and one signed by a key this process does not hold (the member's old key, rotated meanwhile)
        would be stored after that key's cut, so rejected `removed_signer`; re-signing it would vouch for what the
        retired key signed (perhaps a thief's)."""
        if self.signing_key is None:
            return file.left
        unsigned = [left for left in file.left if not left.event.signature]
        other_key = [left for left in file.left if left.event.signature
                     and left.event.signer != self.signing_key.public_key]
        for left in (*unsigned, *other_key):
            self._file_thread.submit(file.remove, left.row_id)
        if unsigned:
            log.error("event outbox %s: %d event(s) a previous run left unsigned dropped (%s): no signature of the "
                      "member that made them, and this process must not sign them as its own", file.path,
                      len(unsigned), _types(unsigned))
        if other_key:
            log.warning("event outbox %s: %d event(s) a previous run left signed by a key this process does not hold "
                        "dropped (%s): the key was rotated meanwhile, and stored now they would be rejected "
                        "removed_signer", file.path, len(other_key), _types(other_key))
        return [left for left in file.left if left.event.signer == self.signing_key.public_key and left.event.signature]

    async def start_in(self, folder: Path | None, *, owner: str) -> None:
        """`start` with the file of `owner`'s that this process claims in `folder` (hearth/events/outbox_file.py; off
        the event loop), or in memory only when `folder` is None; OutboxFileUnavailable when none may be claimed."""
        self.start(await asyncio.to_thread(OutboxFile.claim, folder, owner) if folder is not None else None)

    async def record(self, event: EventEnvelope) -> None:
        """Queue `event` for writing (and, with a file, append it to the file first); returns at once unless
        `max_queued` events are already waiting."""
        await self._room.acquire()
        queued = _Queued(event)
        if self._file_thread is not None:
            # Submitted now, in the order of the calls: the file's rows keep the queue's order.
            queued.kept = self._file_thread.submit(self._keep, queued)
        self._queue.put_nowait(queued)
        event_outbox_depth.set(self.depth)
        if queued.kept is not None:
            try:
                async with asyncio.timeout(append_wait_s):
                    # Shielded: a cancelled caller's event is still appended (and written).
                    await asyncio.shield(asyncio.wrap_future(queued.kept))
            except TimeoutError:
                log.warning("event outbox %s: %s %s not appended within %.0f s (the disk is slow); going on",
                            self.file.path, event.type, event.event_id, append_wait_s)

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every event recorded so far is stored; False when `timeout_s` passed first, or once `unsendable`
        is set (none of them can be stored then)."""
        if self.depth and not (self.unsendable is not None and self.unsendable.is_set()):
            # Waits cancelled however it ends: left running, a join would wait for events nobody writes now.
            waits = {asyncio.ensure_future(self._queue.join())}
            if self.unsendable is not None:
                waits.add(asyncio.ensure_future(self.unsendable.wait()))
            try:
                await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
        return self.depth == 0

    async def stop(self, timeout_s: float) -> None:
        """Write what is left within `timeout_s`, then stop the writer (and close the file: what is still in it is
        the next run's to write)."""
        if self._writer is None:
            return
        written = await self.flush(timeout_s)
        not_written = self.depth
        self._writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._writer
        self._writer = None
        # A last try at keeping what the disk refused (room may have been made since the last `record`), bounded as
        # an append is: a disk that does not answer counts what it had refused as lost.
        not_kept = 0
        if self.file:
            try:
                async with asyncio.timeout(append_wait_s):
                    not_kept = await asyncio.wrap_future(self._file_thread.submit(self._keep_unkept))
            except TimeoutError:
                not_kept = len(self._unkept)
        if not written and self.file is None:
            log.error("%d audit event(s) not written before shutdown", not_written)
        elif not written:
            lost = f", {not_kept} lost: the file refused them ({self._append_fault})" if not_kept else ""
            log.error("%d audit event(s) not written before shutdown; %d kept in %s for the next run%s", not_written,
                      not_written - not_kept, self.file.path, lost)
        if self._file_thread is not None:
            self._file_thread.submit(self.file.close)
            try:
                async with asyncio.timeout(append_wait_s):
                    await asyncio.get_running_loop().run_in_executor(None, self._file_thread.shutdown)
            except TimeoutError:
                log.warning("event outbox %s: its disk did not answer within %.0f s; the file is closed once it does",
                            self.file.path, append_wait_s)
            self._file_thread = None

    def _keep(self, queued: _Queued) -> None:
        """On the file thread: the event signed (by the member that made it: a process after a kill writes it as it is,
        never as its own), then appended to the file behind those it refused before (_keep_unkept)."""
        queued.event = self._signed(queued.event)  # the writer then signs it no more (the same bytes if it did)
        self._unkept.append(queued)
        if self._keep_unkept():
            self._refused_appends += 1

    def _keep_unkept(self) -> int:
        """On the file thread: append the events the file refused and not stored yet, oldest first, up to the first it
        refuses again (those after wait behind it: the file keeps the order they are written in); how many are left.
        A refused one is still written from memory, only not kept across a kill."""
        probing = self._append_fault is not None  # one event first: a disk still full refuses it as well as many
        while self._unkept:
            waiting = list(itertools.islice(self._unkept, 1 if probing else keep_at_once))
            probing = False
            try:
                if len(waiting) == 1:  # the usual case: one event, in a commit of its own
                    waiting[0].row_id = self.file.append(waiting[0].event)
                else:
                    for queued, row_id in zip(waiting, self.file.append_many([queued.event for queued in waiting]),
                                              strict=True):
                        queued.row_id = row_id
            except Exception as error:
                if self._append_fault is None:
                    self._append_fault = write_fault(error)
                    log.error("event outbox %s: %s; events are not kept in it until there is room (they are still "
                              "written while this process runs, and kept once there is room)", self.file.path,
                              self._append_fault)
                self.file.give_back_room()
                return len(self._unkept)
            for _ in waiting:
                self._unkept.popleft()
        if self._append_fault is not None:
            log.warning("event outbox %s: keeping events again (%d recorded while it could not: %s)",
                        self.file.path, self._refused_appends, self._append_fault)
            self._append_fault, self._refused_appends = None, 0
        return 0

    def _signed(self, event: EventEnvelope) -> EventEnvelope:
        """`event` as it goes out: signed by this process's key, unless it carries its maker's signature already."""
        return event if self.signing_key is None or event.signature else sign_event(event, self.signing_key)

    def _forget(self, queued: _Queued) -> None:
        """On the file thread, after the event's append (the thread runs its jobs in order): the event, stored, out of
        the file (or of what waits to be kept)."""
        if queued.row_id is None:
            with contextlib.suppress(ValueError):  # stored before the file kept it: nothing to keep now
                self._unkept.remove(queued)
            return
        try:
            self.file.remove(queued.row_id)
        except Exception as error:  # stored all the same: the next run finds it in the stream
            if self._remove_fault is None:
                self._remove_fault = write_fault(error)
                log.error("event outbox %s: %s; events stored stay in it until there is room (the next run finds "
                          "them in the stream)", self.file.path, self._remove_fault)
            return
        if self._remove_fault is not None:
            log.warning("event outbox %s: removing stored events again (after %s)", self.file.path,
                        self._remove_fault)
            self._remove_fault = None

    async def _write_forever(self) -> None:
        while True:
            queued = await self._queue.get()
            self._writing = queued
            try:
                # Written without waiting for its append: a kill between the two leaves it stored and in the file,
                # which the next run finds in the stream.
                maybe_stored = queued.left_by_previous_run and self._left_maybe_stored
                if not await self._write(queued.event, maybe_stored=maybe_stored) and maybe_stored:
                    self._left_maybe_stored = False  # we stored it: the previous run never tried the ones after it
                if self._file_thread is not None:
                    # Not waited for (one thread hop less per event): a kill before it is what recovery looks for.
                    self._file_thread.submit(self._forget, queued)
            finally:
                self._writing = None
                self._queue.task_done()
                if queued.holds_room:
                    self._room.release()
                event_outbox_depth.set(self.depth)

    async def _write(self, event: EventEnvelope, *, maybe_stored: bool = False) -> bool:
        """Write `event` until it is stored; True when it was found stored by an earlier try, or by an earlier process
        (`maybe_stored`: that one may have stored it at any time)."""
        if self.publish_delay_s:
            await asyncio.sleep(self.publish_delay_s)
        first_try_at = time.monotonic()
        failures = 0
        while True:
            try:
                if ((maybe_stored or (failures and time.monotonic() - first_try_at > unchecked_retry_horizon_s))
                        and await self._stored_already(event)):
                    log.info("event %s %s was stored by an earlier try", event.type, event.event_id)
                    return True
                # After its first failure the event's own WARNING below says it waits: not every attempt.
                await publish_event(self.js, self._signed(event),
                                    retry_log_level=logging.DEBUG if failures else logging.WARNING)
                return False
            except Exception as error:  # publish_event already retried the transient ones; keep the order
                failures += 1
                if failures == 1:
                    log.warning("event %s %s not written yet (%s); retrying until it is", event.type,
                                event.event_id, error)
                await asyncio.sleep(self.retry_wait_s)

    async def _stored_already(self, event: EventEnvelope) -> bool:
        """Whether the stream holds `event`, read from its subject's events (one kind of one pipeline's: a few)."""
        subject = event_subject(event)
        async with contextlib.aclosing(read_stream(self.js, stream_for_subject(subject),
                                                   subject_filter=subject)) as stored:
            async for item in stored:
                if isinstance(item, StoredEvent) and item.headers.get(MSG_ID_HEADER) == event.event_id:
                    return True
        return False


def _types(events: list[LeftEvent]) -> str:
    return ", ".join(sorted({left.event.type for left in events}))
