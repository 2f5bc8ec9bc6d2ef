"""Projector: follows both event streams from the stored positions and applies them to a SQLite read model.

It lives in hearth/readmodels/ (not hearth/services/projector/) so the orchestrator can run the same projector
in-process for its routing read model (docs/design.md §1 forbids services importing each other). It is given a JetStream
context and never opens connections itself; metrics are read from its public counters by a collector
(hearth/services/projector/metrics.py), so this module imports neither nats nor prometheus-client (events it rejects
are counted in events.metrics' `hearth_events_rejected_total`, shared with every process that projects).

Flow: at start, a read model from before applied_events first has the ids of what it applied recorded
(readmodels.applied_backfill); then one follower task per stream reads `read_stream(..., follow=True)` from
`position + 1` into a bounded queue; one applier task drains the queue in batches of up to `batch_max_events` and
applies each batch in a worker thread in ONE transaction (rows + positions). A follower whose read fails (broker
gone) starts again from the last sequence it handed over; an applier whose transaction fails reloads the positions
from the database and restarts the followers from there, so nothing is lost or applied twice. A batch that fails on
a message's content is applied message by message instead, and the one no handler can apply is recorded as rejected
(readmodels.unapplicable); a file SQLite finds damaged is no batch's: nothing more is applied, `found_unusable` is set
for the owner to say in one line what it does (end, or rebuild a scratch file: readmodels/scratch_model.py). A
stream deleted and created again is told by its creation time and reported (readmodels.stream_identity,
`replaced_streams`), for a rebuild. With a retention policy, a third task prunes
history every `prune_interval_s` (readmodels.retention), in short transactions taken in turn with the applier's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from hearth.events.consume import SkippedMessage, StoredEvent, read_stream, stream_last_seq
from hearth.events.metrics import events_rejected_total
from hearth.events.signing import REJECTION_REASONS, EventVerifier, RejectionReason
from hearth.events.streams import ALL_STREAMS, StreamSetup, stream_info_timeout_s
from hearth.readmodels.applied_backfill import record_ids_applied_before
from hearth.readmodels.batch_transaction import apply_in_one_transaction
from hearth.readmodels.db import ReadModelUnusable, damaged_file, open_engine, refusing_a_damaged_file, upgrade_database
from hearth.readmodels.positions import ConcurrentProjectionError, load_stream_identities, record_stream_identity
from hearth.readmodels.projection import PROJECTION_NAME, ReadModelProjection, load_positions
from hearth.readmodels.retention import RetentionPolicy, keep_pruning
from hearth.readmodels.storage_fault_log import StorageFaultLog
from hearth.readmodels.stream_identity import StreamIdentities, poll_streams, stream_state
from hearth.readmodels.task_cancel import cancel_within
from hearth.readmodels.unapplicable import apply_rejecting_the_unapplicable

log = logging.getLogger(__name__)

batch_max_events = 2_000
queue_max_events = 20_000
lag_poll_interval_s = 10.0  # applied messages move the lag gauges too; a Prometheus scrape comes every 15 s
follower_retry_initial_s = 0.2
follower_retry_max_s = 5.0
apply_retry_initial_s = 0.5
apply_retry_max_s = 10.0
stop_timeout_s = 10.0

Message = StoredEvent | SkippedMessage

for _reason in REJECTION_REASONS:  # every reason from the start: a rate over one not seen yet reads 0, not nothing
    events_rejected_total.labels(reason=_reason)


class Projector:
    """Keeps the read model at `db_path` up to date with the event streams; start() once, stop() at the end.

    `session_factory` (after start) reads the same database, e.g. for ShardRouter. With a `verifier` (a
    community's roster) only events that pass it are applied; the others become rejected_events rows.
    `stream_setup` says whether it creates the streams it follows (an open broker) or waits for the steward's.
    With a `retention` policy history is pruned as it ages and rejected events are kept as samples; without, kept.
    """

    def __init__(
        self,
        db_path: str | Path,
        js: Any,
        *,
        projection: ReadModelProjection | None = None,
        streams: Iterable[str] = ALL_STREAMS,
        stream_setup: StreamSetup = StreamSetup(),
        batch_max_events: int = batch_max_events,
        verifier: EventVerifier | None = None,
        retention: RetentionPolicy | None = None,
    ) -> None:
        self.db_path = Path(db_path)
        self._js = js
        self.projection = projection or ReadModelProjection(PROJECTION_NAME, verifier=verifier, retention=retention)
        self.retention = retention
        self.streams: tuple[str, ...] = tuple(streams)
        self._stream_setup = stream_setup
        self._batch_max_events = batch_max_events
        self.engine = None
        self.session_factory: sessionmaker[Session] | None = None
        # Public counters, read by the metrics collector and by tests.
        self.positions: dict[str, int] = {stream: 0 for stream in self.streams}
        self.stream_last_seqs: dict[str, int] = {stream: 0 for stream in self.streams}
        self.applied_total: dict[str, int] = {stream: 0 for stream in self.streams}
        self.skipped_total: dict[str, int] = {stream: 0 for stream in self.streams}
        self.rejected_total: dict[str, int] = {}  # by reason
        self.applied_by_type: dict[str, int] = {}  # events applied (not rejected), by event type
        self.batches_total = 0
        self.apply_failures_total = 0
        self.pruned_total = 0  # history rows deleted by the retention policy
        # The applier and the pruner write in turn: one SQLite writer at a time, neither waiting on the other's lock.
        self._write_turn = asyncio.Lock()
        self._handed_over: dict[str, int] = {}
        # The stream each position was taken in, and those created again since (readmodels.stream_identity).
        self._identities = StreamIdentities(self.streams)
        self._first_applied = asyncio.Event()  # a position moved off 0: the stream it is in is recorded at once
        # One resume (followers replaced) at a time: two at once left followers no one stopped.
        self._resume_lock = asyncio.Lock()
        # Per stream, (seq, stored at epoch s) of every message handed to the applier and not applied yet: how old
        # the oldest one is tells how far behind the read model is in time.
        self._pending: dict[str, deque[tuple[int, float]]] = {stream: deque() for stream in self.streams}
        # Each message with the generation of the followers that read it: followers replaced by a resume may still
        # hand one over while they end, and the applier drops it.
        self._queue: asyncio.Queue[tuple[int, Message]] = asyncio.Queue(maxsize=queue_max_events)
        self._generation = 0
        self._followers: dict[str, asyncio.Task] = {}
        self._tasks: list[asyncio.Task] = []
        self._progress = asyncio.Condition()
        self._started = False
        self.unusable: ReadModelUnusable | None = None  # the file found damaged (db.damaged_file): nothing more applied
        self.found_unusable = asyncio.Event()
        self._storage_faults = StorageFaultLog(self.db_path)

    # ---- lifecycle --------------------------------------------------------------------------------------

    async def start(self) -> "Projector":
        """Migrate the database, load the positions, start following both streams from position + 1."""
        if self._started:
            return self
        await asyncio.to_thread(upgrade_database, self.db_path)
        self.engine = open_engine(self.db_path)
        self.session_factory = sessionmaker(self.engine, expire_on_commit=False)
        await self._stream_setup.ready(self._js, self.streams)
        with refusing_a_damaged_file(self.db_path):  # the migration read only the schema: damage elsewhere shows here
            await self._load_positions()
            for stream in self.streams:  # a stream created again is reported before any of its messages is read
                await self._check_stream(stream)
            # Before anything is applied: the ids of what a read model from before applied_events applied.
            await record_ids_applied_before(self._js, self.session_factory, self.projection, {
                stream: position for stream, position in self.positions.items() if stream not in self.replaced_streams})
        self._started = True
        for stream in self.streams:
            self._start_follower(stream)
        self._tasks = [
            asyncio.create_task(self._apply_loop(), name="projector-apply"),
            asyncio.create_task(self._lag_loop(), name="projector-lag"),
        ]
        if self.retention is not None:
            pruning = keep_pruning(self.session_factory, self.retention, self.projection.name, self._write_turn,
                                   self._count_pruned)
            self._tasks.append(asyncio.create_task(pruning, name="projector-prune"))
            self._tasks[-1].add_done_callback(self._pruning_ended)
        log.info("projector %s on %s started at %s", self.projection.name, self.db_path, self.positions)
        return self

    async def stop(self) -> None:
        """Stop following; a batch being written is allowed to commit first."""
        if not self._started:
            return
        self._started = False
        tasks = list(self._followers.values()) + self._tasks
        self._followers.clear()
        self._tasks = []
        await cancel_within(tasks, stop_timeout_s)
        # The applier may have been restarting followers while we cancelled it.
        leftovers = list(self._followers.values())
        self._followers.clear()
        await cancel_within(leftovers, stop_timeout_s)
        if self.engine is not None:
            self.engine.dispose()
        log.info("projector %s stopped at %s", self.projection.name, self.positions)

    async def __aenter__(self) -> "Projector":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- waiting for the read model ---------------------------------------------------------------------

    async def wait_for_position(self, stream: str, seq: int, timeout_s: float) -> None:
        """Return once `stream` is applied up to `seq` (e.g. a PubAck's seq); TimeoutError otherwise."""
        if stream not in self.positions:
            raise ValueError(f"this projector does not follow {stream!r} (it follows {self.streams})")
        # asyncio.timeout, not wait_for, here and below: on Python 3.11 a wait_for whose wait ends in the very turn a
        # cancellation lands swallows it, and the task being stopped goes on (a host's watch for holes, for ever).
        async with self._progress, asyncio.timeout(timeout_s):
            await self._progress.wait_for(lambda: self.positions[stream] >= seq)

    async def wait_until_caught_up(self, timeout_s: float) -> dict[str, int]:
        """Wait until every stream is applied up to its last sequence as of this call; returns those."""
        deadline = time.monotonic() + timeout_s
        targets = {}
        for stream in self.streams:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                targets[stream] = await stream_last_seq(self._js, stream)
        for stream, seq in targets.items():
            await self.wait_for_position(stream, seq, max(0.0, deadline - time.monotonic()))
        return targets

    @property
    def replaced_streams(self) -> dict[str, str]:
        """Streams found deleted and created again since the position was taken in them, with their new creation
        time (a rebuild is due)."""
        return self._identities.replaced

    def lag(self, stream: str) -> int:
        """Events stored in `stream` but not applied yet (as of the last poll of its last sequence)."""
        return max(0, self.stream_last_seqs[stream] - self.positions[stream])

    def lag_seconds(self, stream: str, now_s: float | None = None) -> float:
        """Age of the oldest message read from `stream` and not applied yet (by the time the server stored it);
        0 when everything read has been applied."""
        pending = self._pending[stream]
        if not pending:
            return 0.0
        return max(0.0, (time.time() if now_s is None else now_s) - pending[0][1])

    # ---- internals --------------------------------------------------------------------------------------

    async def _load_positions(self) -> None:
        def read() -> tuple[dict[str, int], dict[str, str | None]]:
            with self.session_factory() as session:
                return load_positions(session, self.projection.name), load_stream_identities(session,
                                                                                              self.projection.name)

        stored, identities = await asyncio.to_thread(read)
        for stream in self.streams:
            self.positions[stream] = stored.get(stream, 0)
            self._identities.recorded[stream] = identities.get(stream)
            self._handed_over[stream] = self.positions[stream]

    def _start_follower(self, stream: str) -> None:
        if not self._started:
            return
        self._followers[stream] = asyncio.create_task(self._follow(stream, self._generation),
                                                      name=f"projector-follow-{stream}")

    async def _follow(self, stream: str, generation: int) -> None:
        retry_s = follower_retry_initial_s
        while generation == self._generation:
            from_seq = self._handed_over[stream] + 1
            try:
                messages = read_stream(self._js, stream, from_seq=from_seq, follow=True)
                async with contextlib.aclosing(messages) as reader:
                    async for message in reader:
                        await self._queue.put((generation, message))
                        if generation != self._generation:
                            return
                        self._handed_over[stream] = message.seq
                        self._pending[stream].append((message.seq, message.time.timestamp()))
                        retry_s = follower_retry_initial_s
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the follower must outlive any broker or stream trouble
                log.warning("projector: reading %s from seq %d failed (%s: %s); retrying in %.1f s",
                            stream, self._handed_over[stream] + 1, type(error).__name__, error, retry_s)
                await asyncio.sleep(retry_s)
                retry_s = min(retry_s * 2, follower_retry_max_s)

    async def _apply_loop(self) -> None:
        retry_s = apply_retry_initial_s
        while True:
            batch = await self._next_batch()
            try:
                async with self._write_turn:
                    await self._apply_in_thread(batch)
                retry_s = apply_retry_initial_s
                self._storage_faults.cleared()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                self.apply_failures_total += 1
                if (damaged := damaged_file(self.db_path, error)) is not None:  # no retry can mend it
                    self._give_up(damaged)
                    return
                if isinstance(error, ConcurrentProjectionError):  # no fault of the batch: a second writer of the file
                    log.warning("projector: %s (is another projector writing %s?); resuming from the stored positions "
                                "in %.1f s", error, self.db_path, retry_s)
                elif not self._storage_faults.said(error, retry_s):  # a full disk, a read-only file: said there
                    log.exception("projector: applying a batch of %d failed; resuming from the stored positions "
                                  "in %.1f s", len(batch), retry_s)
                await asyncio.sleep(retry_s)
                retry_s = min(retry_s * 2, apply_retry_max_s)
                await self._resume_from_database()

    async def _next_batch(self) -> list[Message]:
        """Messages of the current followers only: those of followers a resume replaced are dropped."""
        while True:
            generation, message = await self._queue.get()
            if generation == self._generation:
                break
        batch = [message]
        while len(batch) < self._batch_max_events and not self._queue.empty():
            queued_generation, message = self._queue.get_nowait()
            if queued_generation == generation:
                batch.append(message)
        return batch

    async def _apply_in_thread(self, batch: list[Message]) -> None:
        work = asyncio.ensure_future(asyncio.to_thread(self._apply_batch, batch))
        try:
            newly_applied = await asyncio.shield(work)
        except asyncio.CancelledError:
            # Let an in-flight transaction finish so the in-memory positions match the database.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(stop_timeout_s):
                    newly_applied = await work
                await self._record(batch, newly_applied)
            raise
        await self._record(batch, newly_applied)

    def _apply_batch(self, batch: list[Message]) -> list[Message]:
        return apply_rejecting_the_unapplicable(self._apply_transaction, batch, projection=self.projection.name)

    def _apply_transaction(self, batch: Sequence[Message], reject_as: RejectionReason | None) -> list[Message]:
        outcome = apply_in_one_transaction(self.session_factory, self.projection, batch, reject_as)
        # Counted only now that the transaction committed: a batch rolled back and applied again counts once.
        for rejection in outcome.rejections:
            self.rejected_total[rejection.reason] = self.rejected_total.get(rejection.reason, 0) + 1
            events_rejected_total.labels(reason=rejection.reason).inc()
        for event_type in outcome.applied_types:
            self.applied_by_type[event_type] = self.applied_by_type.get(event_type, 0) + 1
        return outcome.newly_applied

    async def _record(self, batch: list[Message], newly_applied: list[Message]) -> None:
        for message in newly_applied:
            self.applied_total[message.stream] += 1
            if isinstance(message, SkippedMessage):
                self.skipped_total[message.stream] += 1
        async with self._progress:
            for message in batch:
                if message.seq > self.positions[message.stream]:
                    if self.positions[message.stream] == 0:
                        self._first_applied.set()
                    self.positions[message.stream] = message.seq
                if message.seq > self.stream_last_seqs[message.stream]:
                    self.stream_last_seqs[message.stream] = message.seq
            for stream, pending in self._pending.items():
                while pending and pending[0][0] <= self.positions[stream]:
                    pending.popleft()
            self.batches_total += 1
            self._progress.notify_all()

    async def _resume_from_database(self) -> None:
        """Replace the followers with ones reading from the stored positions."""
        async with self._resume_lock:
            self._generation += 1
            await cancel_within(list(self._followers.values()), stop_timeout_s)
            while not self._queue.empty():
                self._queue.get_nowait()
            for pending in self._pending.values():
                pending.clear()
            await self._load_positions()
            async with self._progress:  # another writer of the file may have moved them past what a caller awaits
                self._progress.notify_all()
            for each in self.streams:
                self._start_follower(each)

    def _count_pruned(self, rows: int) -> None:
        self.pruned_total += rows

    def _pruning_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and (damaged := damaged_file(self.db_path, task.exception())) is not None:
            self._give_up(damaged)

    def _give_up(self, damaged: ReadModelUnusable) -> None:  # nothing more is applied; said by the owner, which acts
        if self.unusable is None:
            self.unusable = damaged
            self.found_unusable.set()

    async def _lag_loop(self) -> None:
        await poll_streams(self.streams, self._check_stream, lag_poll_interval_s, at_once=self._first_applied)

    async def _check_stream(self, stream: str) -> None:
        """Poll `stream`'s last sequence, and whether it is still the stream the position was taken in."""
        try:
            async with asyncio.timeout(stream_info_timeout_s):  # stream_state keeps a stop that lands as it is answered
                state = await stream_state(self._js, stream)
            self.stream_last_seqs[stream] = max(state.last_seq, self.positions[stream])
            await self._identities.check(stream, state, self.positions[stream], record=self._record_stream_identity)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            log.debug("projector: cannot read %s's state: %s", stream, error)

    async def _record_stream_identity(self, stream: str, created: str) -> None:
        def record() -> None:
            with self.session_factory() as session, session.begin():
                record_stream_identity(session, self.projection.name, stream, created)

        await asyncio.to_thread(record)
