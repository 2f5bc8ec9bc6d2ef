"""OutboxFile: the durable half of the event outbox, a small SQLite file that holds each recorded event until
JetStream acknowledged it, so that a process killed with events still queued leaves them to its next run.

Why SQLite and not an append-only file: events leave the file from its front as they are acked, and it must stay
bounded; SQLite gives an atomic append, a removal and a reuse of the freed pages without a compaction of our own,
and a write torn by a kill is rolled back, never read back half. In WAL mode with `synchronous=NORMAL`
a committed append is in the operating system's hands before `append` returns: it survives the process being
killed (SIGKILL, the OOM killer, a crash); a power cut of the machine may lose the last moments' appends (an fsync
per event would put a disk flush on every call's path).

It also keeps which calls the process began and has not recorded the end of (`open_calls`, marked in the transaction
that appends the call's first and last events): those a killed process left, `calls_left_open`, are its successor's to
close (hearth/services/orchestrator/service.py records `pipeline.aborted` for each), or they would read as under way
in every read model for ever.

One process per file: a process claims the first file of its owner's (`<owner>.sqlite`, `<owner>.2.sqlite`, ...)
whose lock it can take (flock, dropped by the kernel however the process ends), so two processes of one member
never share a file and a restarted one takes over the file its killed predecessor held (of N processes of one owner
killed, a file waits until N are started again). Every method but `claim` runs on the outbox's one file thread
(hearth/events/outbox.py), never on the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import re
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hearth.events.models import EventEnvelope, decode_event, encode_event
from hearth.events.newer_hearth import EventOfANewerHearth

log = logging.getLogger(__name__)

# Processes of one owner (one member's orchestrators) on one machine, each with its own file.
max_files_per_owner = 16
# The write-ahead log is cut back to this after a checkpoint, so an outbox that once backed up shrinks again.
journal_size_limit_bytes = 4 * 1024 * 1024
_SAFE_OWNER = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_SCHEMA = "CREATE TABLE IF NOT EXISTS events (row_id INTEGER PRIMARY KEY, event BLOB NOT NULL)"
_OPEN_CALLS_SCHEMA = "CREATE TABLE IF NOT EXISTS open_calls (pipeline_id TEXT PRIMARY KEY)"
# The events that give a call its row in the read models (the first of them opens it), and those that end it.
_CALL_OPENING_TYPES = frozenset({"pipeline.constructed", "pipeline.fallback_local"})
_CALL_ENDING_TYPES = frozenset({"pipeline.completed", "pipeline.aborted"})


class OutboxFileUnavailable(RuntimeError):
    """No outbox file could be claimed (every one taken, or the folder not writable); one line for the user."""


@dataclass(frozen=True)
class LeftEvent:
    """An event a previous process recorded and did not see stored, with its row in the file."""

    row_id: int
    event: EventEnvelope


def _call_mark(event: EventEnvelope) -> str | None:
    """The statement that marks `event`'s call open or ended in the outbox (None: it neither opens nor ends one)."""
    if event.type in _CALL_OPENING_TYPES:
        return "INSERT OR IGNORE INTO open_calls (pipeline_id) VALUES (?)"
    if event.type in _CALL_ENDING_TYPES:
        return "DELETE FROM open_calls WHERE pipeline_id = ?"
    return None

class OutboxFile:
    """One claimed outbox file: `append` before an event is queued, `remove` once JetStream acked it."""

    def __init__(self, path: Path, connection: sqlite3.Connection, lock_file) -> None:
        self.path = path
        self._connection = connection
        self._lock_file = lock_file
        try:
            # What the previous process left, oldest first, read when the file was claimed.
            self.left: list[LeftEvent] = self._read_left()
            # The calls it began and never recorded the end of (it was killed under them), in the order begun.
            self.calls_left_open: list[str] = [pipeline_id for (pipeline_id,) in connection.execute(
                "SELECT pipeline_id FROM open_calls ORDER BY rowid")]
        except sqlite3.Error:
            connection.close()
            raise

    @classmethod
    def claim(cls, folder: Path, owner: str) -> OutboxFile:
        """The first of `owner`'s files in `folder` that no living process holds, opened (created when missing);
        blocking: call it off the event loop."""
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # ours alone, as a state folder is
            for number in range(1, max_files_per_owner + 1):
                path = folder / f"{file_stem(owner)}{'' if number == 1 else f'.{number}'}.sqlite"
                lock_file = open(path.with_name(path.name + ".lock"), "a")  # noqa: SIM115 (held for the file's life)
                try:
                    fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    lock_file.close()
                    continue
                try:
                    return cls(path, _open_database(path), lock_file)
                except BaseException:
                    lock_file.close()
                    raise
        except (OSError, sqlite3.Error) as error:
            raise OutboxFileUnavailable(f"event outbox folder {folder}: {write_fault(error)}") from None
        raise OutboxFileUnavailable(f"event outbox folder {folder}: {max_files_per_owner} processes of {owner!r} "
                                    "already hold its files")

    def append(self, event: EventEnvelope) -> int:
        """Store `event`; its row id, for `remove`. A call's opening or ending event marks the call open or ended in
        the same transaction, so a kill leaves both or neither."""
        if _call_mark(event) is None:  # autocommit: the statement is its own transaction, committed when it returns
            return self._connection.execute("INSERT INTO events (event) VALUES (?)", (encode_event(event),)).lastrowid
        return self.append_many([event])[0]

    def append_many(self, events: Sequence[EventEnvelope]) -> list[int]:
        """Store `events` in order, in one transaction (all of them or none): one commit's pages in the write-ahead
        log rather than one per event, which matters when the events waited for room on a full disk."""
        self._connection.execute("BEGIN")
        try:
            row_ids = []
            for event in events:
                row_ids.append(self._connection.execute(
                    "INSERT INTO events (event) VALUES (?)", (encode_event(event),)).lastrowid)
                mark = _call_mark(event)
                if mark is not None:
                    self._connection.execute(mark, (event.pipeline_id,))
            self._connection.execute("COMMIT")
        except BaseException:
            if self._connection.in_transaction:  # SQLite may have rolled it back itself (a full disk)
                self._connection.execute("ROLLBACK")
            raise
        return row_ids

    def give_back_room(self) -> None:
        """Empty the write-ahead log into the file and cut it to nothing (after the disk refused a write): each commit
        adds a page or more to the log until its next checkpoint, which a full disk may never let it reach."""
        with contextlib.suppress(sqlite3.Error):
            self._connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def remove(self, row_id: int) -> None:
        self._connection.execute("DELETE FROM events WHERE row_id = ?", (row_id,))

    def count(self) -> int:
        return self._connection.execute("SELECT count(*) FROM events").fetchone()[0]

    def close(self) -> None:
        """Close the database and drop the lock: another process may claim the file from now on."""
        with contextlib.suppress(sqlite3.Error):
            self._connection.close()
        self._lock_file.close()

    def _read_left(self) -> list[LeftEvent]:
        """What a previous process left that this one writes. An event only a newer hearth reads (this member ran a
        newer hearth on the file, then an older one) stays in the file, unwritten: this hearth cannot write it, and
        the newer one, run on the file again, writes it then (`kept_for_a_newer_hearth` counts them)."""
        left, newer = [], []
        for row_id, data in self._connection.execute("SELECT row_id, event FROM events ORDER BY row_id").fetchall():
            try:
                left.append(LeftEvent(row_id, decode_event(data)))
            except EventOfANewerHearth as refusal:
                newer.append(refusal.newer.label)
            except ValueError as error:  # pydantic's ValidationError too: not an event this version can write
                log.error("event outbox %s: row %d is not an event (%s); dropped", self.path, row_id, error)
                self.remove(row_id)
        self.kept_for_a_newer_hearth = len(newer)
        if newer:
            log.warning("event outbox %s: %d event(s) a newer hearth left (%s) kept in the file unwritten: this hearth "
                        "cannot write them; run the newer hearth again to store them", self.path, len(newer),
                        ", ".join(sorted(set(newer))))
        return left


def is_disk_full(error: BaseException) -> bool:
    """Whether `error` (or the DB-API error an SQLAlchemy one wraps) says the disk has no room: SQLite's SQLITE_FULL,
    or ENOSPC, by their codes (not by their words)."""
    cause = getattr(error, "orig", None) or error
    code = getattr(cause, "sqlite_errorcode", None)
    return (code is not None and code & 0xFF == sqlite3.SQLITE_FULL) or getattr(cause, "errno", None) == errno.ENOSPC


def write_fault(error: BaseException) -> str:
    """`error` in a few words for a log line, led by "disk full" when the disk has no room (is_disk_full), so that an
    operator reads at once what to free."""
    return f"disk full ({error})" if is_disk_full(error) else str(error)


def file_stem(owner: str) -> str:
    """`owner` (a node id) as a file name: itself when it is plainly one, else a digest of it."""
    if _SAFE_OWNER.match(owner):
        return owner
    return "node-" + hashlib.sha256(owner.encode()).hexdigest()[:16]


def _open_database(path: Path) -> sqlite3.Connection:
    """`path` opened with its table; a file that is not a database (damaged, foreign) is moved aside, named in an
    ERROR, and a fresh one started, so that the process still runs and its events are still kept."""
    try:
        return _connect(path)
    except sqlite3.DatabaseError as error:
        if isinstance(error, sqlite3.OperationalError):  # cannot open or write it (permissions): not a bad file
            raise
        aside = path.with_name(f"{path.name}.unreadable-{int(time.time())}")
        path.rename(aside)
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                path.with_name(path.name + suffix).rename(aside.with_name(aside.name + suffix))
        log.error("event outbox %s did not read as a database (%s): moved to %s, starting an empty one", path,
                  error, aside)
        return _connect(path)


def _connect(path: Path) -> sqlite3.Connection:
    # check_same_thread off: claimed on one worker thread, used after on the outbox's file thread, never both at once.
    connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=NORMAL")
        connection.execute(f"PRAGMA journal_size_limit={journal_size_limit_bytes}")
        connection.execute(_SCHEMA)
        connection.execute(_OPEN_CALLS_SCHEMA)
        connection.execute("SELECT count(*) FROM events").fetchone()
    except sqlite3.Error:
        connection.close()
        raise
    return connection
