"""ScratchReadModel: a read model one process keeps for itself on a scratch SQLite file (`hearth host`'s coverage,
`hearth orchestrator`'s routing without --db), kept by an in-process projector and rebuilt from the event log when
SQLite finds that file damaged.

The file is purely derived (the log holds every event it applied) and nobody else reads it, so a damaged one is no
reason to stop serving, nor to go on deciding on a view that no longer moves (its projector applies nothing more once
the file is found damaged): one WARNING line says so, a new projector reads the log from its start into a fresh file
(`coverage-N.sqlite`), reads go on from the old view until the new one has caught up, and the damaged file is then
moved aside (`….damaged`; the scratch folder goes with the process). A disk that damages every file it is given ends
the process in one line (ScratchModelGivenUp) once `max_rebuilds` rebuilds were damaged too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from sqlalchemy.orm import Session

from hearth.readmodels.db import ReadModelUnusable
from hearth.readmodels.runner import Projector

log = logging.getLogger(__name__)

# Rebuilds in one process's life: past them the disk, not one torn page, is what fails.
max_rebuilds = 3
# A new projector whose start failed (the broker away) tries again after this.
start_retry_s = 1.0
# SQLite's files beside a database in WAL mode, moved aside with it.
_SIDE_FILES = ("", "-wal", "-shm")


class ScratchModelGivenUp(RuntimeError):
    """The scratch file was found damaged again past `max_rebuilds` rebuilds: one line, for its process to end with."""


class ScratchReadModel:
    """A process's own read model in `folder`/`file_name`, projected by `new_projector(path)`: `session_factory`
    reads it, `batches_total` changes whenever it does (a rebuild included), `wait_until_caught_up` waits for it to
    reach the log's end (as a Projector's do, so either serves a ShardRouter). `owner` and `what` name it in its lines
    ("host", "coverage read model")."""

    def __init__(self, folder: Path, new_projector: Callable[[Path], Projector], *, file_name: str, owner: str,
                 what: str, rebuild_catch_up_s: float) -> None:
        self.folder = Path(folder)
        self.file_name, self.owner, self.what = file_name, owner, what
        self._new_projector, self._rebuild_catch_up_s = new_projector, rebuild_catch_up_s
        self.projector = new_projector(self.folder / file_name)
        self.rebuilds = 0
        # Batches applied by the projectors before the current one (each new projector counts from 0).
        self._earlier_batches = 0
        self.given_up: str | None = None
        self.found_given_up = asyncio.Event()
        self._watch: asyncio.Task | None = None

    async def start(self) -> "ScratchReadModel":
        """Start projecting (a file found damaged as it starts is rebuilt too); ScratchModelGivenUp past
        `max_rebuilds`."""
        while True:
            try:
                await self.projector.start()
                break
            except ReadModelUnusable as damaged:
                self.projector = self._rebuilt_projector(damaged, self.projector, running=False)
        self._watch = asyncio.create_task(self._rebuild_when_damaged(), name=f"{self.owner}-read-model-rebuild")
        return self

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
            self._watch = None
        await self.projector.stop()

    def session_factory(self) -> Session:
        """A session on the current file (a rebuild replaces it)."""
        return self.projector.session_factory()

    @property
    def batches_total(self) -> int:
        """What changes whenever the read model does (ShardRouter's `read_model_version`): batches applied, counted
        across rebuilds, plus one for each rebuild."""
        return self._earlier_batches + self.rebuilds + self.projector.batches_total

    async def wait_until_caught_up(self, timeout_s: float) -> dict[str, int]:
        """The projector's wait; ScratchModelGivenUp (one line) once the file was damaged past `max_rebuilds`."""
        if self.given_up is not None:
            raise ScratchModelGivenUp(self.given_up)
        return await self.projector.wait_until_caught_up(timeout_s=timeout_s)

    async def _rebuild_when_damaged(self) -> None:
        while True:
            await self.projector.found_unusable.wait()
            damaged = self.projector
            try:
                fresh = self._rebuilt_projector(damaged.unusable, damaged, running=True)
            except ScratchModelGivenUp:
                return  # said, and `found_given_up` set: its owner ends
            while not await self._started(fresh):
                try:
                    fresh = self._rebuilt_projector(fresh.unusable, fresh, running=False)
                except ScratchModelGivenUp:
                    return
            # The old view, stale but readable, serves reads until the new one has read the log as it stands.
            with contextlib.suppress(Exception):  # not there in time: the new view's reads wait on their catch-up
                await fresh.wait_until_caught_up(self._rebuild_catch_up_s)
            self._earlier_batches += damaged.batches_total
            self.projector = fresh
            await damaged.stop()
            await asyncio.to_thread(_move_aside, damaged.db_path)

    async def _started(self, projector: Projector) -> bool:
        """Start `projector`, again after a pause while it fails otherwise (the broker away); False when SQLite finds
        its file damaged (ReadModelUnusable kept in `unusable`)."""
        while True:
            try:
                await projector.start()
                return True
            except ReadModelUnusable as damaged:
                projector.unusable = damaged
                return False
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("%s: the rebuild of its %s could not start (%s); trying again", self.owner, self.what,
                            error)
                await asyncio.sleep(start_retry_s)

    def _rebuilt_projector(self, damaged: ReadModelUnusable | None, projector: Projector, *,
                           running: bool) -> Projector:
        """A new projector on a fresh file in place of `projector` (its file moved aside now unless it is `running`:
        its view serves reads meanwhile), said in one WARNING line; ScratchModelGivenUp (also logged) past
        `max_rebuilds`."""
        if self.rebuilds >= max_rebuilds:
            self.given_up = (f"{damaged} (the {self.owner}'s own {self.what}, rebuilt {self.rebuilds} times: the disk "
                             f"under {self.folder} damages what is written there)")
            log.error("%s: %s", self.owner, self.given_up)
            self.found_given_up.set()
            raise ScratchModelGivenUp(self.given_up)
        self.rebuilds += 1
        name = Path(self.file_name)
        fresh_path = self.folder / f"{name.stem}-{self.rebuilds}{name.suffix}"
        said = (damaged.sqlite_said or str(damaged)) if damaged is not None else "unreadable"
        log.warning("%s: its %s %s is damaged (%s): rebuilding it from the event log into %s, the damaged file moved "
                    "aside to %s.damaged", self.owner, self.what, projector.db_path, said, fresh_path.name,
                    projector.db_path.name)
        if not running:
            if projector.engine is not None:
                projector.engine.dispose()
            _move_aside(projector.db_path)
        return self._new_projector(fresh_path)


def _move_aside(path: Path) -> None:
    """`path` and its WAL files renamed to `path`.damaged…, kept for a look while the process runs."""
    for suffix in _SIDE_FILES:
        with contextlib.suppress(FileNotFoundError):
            path.with_name(path.name + suffix).replace(path.with_name(f"{path.name}.damaged{suffix}"))
