"""Says a projector's read-model file refusing its writes (a full disk, a read-only file) at most once every
`repeat_every_s`, and once when writes work again after such a line, instead of a line at every retry (a nearly full
disk that refuses some batches and takes others included)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from hearth.events.outbox_file import is_disk_full
from hearth.readmodels.db import storage_fault

# The projector's own lines: said under its logger, where operators and its tests look for them.
log = logging.getLogger("hearth.readmodels.runner")

# While the same file keeps refusing, its ERROR is said again this often (the retries in between are DEBUG).
repeat_every_s = 300.0


class StorageFaultLog:
    """The storage faults of one read-model file, as the projector retries its batches."""

    def __init__(self, db_path: Path, *, clock=time.monotonic) -> None:
        self.db_path = db_path
        self._clock = clock
        self._failed_tries = 0  # since the last ERROR said
        self._said_at: float | None = None
        self._recovery_due = False  # an ERROR said, and no line since that writes work again

    def said(self, error: BaseException, retry_s: float) -> bool:
        """Whether `error` is the file refusing writes (db.storage_fault); if so, said when due."""
        fault = storage_fault(error)
        if fault is None:
            return False
        self._failed_tries += 1
        now = self._clock()
        if self._said_at is None or now - self._said_at >= repeat_every_s:
            self._said_at, self._recovery_due = now, True
            disk_full = "disk full: " if is_disk_full(error) else ""
            log.error("projector: cannot write %s (%s%s); nothing of the batch was applied, nor any after it until it "
                      "can be (%d refused tries since this was last said; said at most every %.0f s), trying again "
                      "in %.1f s",
                      self.db_path, disk_full, fault, self._failed_tries, repeat_every_s, retry_s)
            self._failed_tries = 0
        else:
            log.debug("projector: cannot write %s (%s); trying again in %.1f s", self.db_path, fault, retry_s)
        return True

    def cleared(self) -> None:
        """A batch was written: said once after an ERROR (the next refusal within `repeat_every_s` of it is DEBUG)."""
        if self._recovery_due:
            log.warning("projector: writing %s again; applying from where it stopped", self.db_path)
            self._recovery_due = False
