"""A process's own scratch folder in the temporary directory (a host's coverage, an orchestrator's routing read
model): removed however the process ends, and, when it could not be (SIGKILL, a crash), by the next process that
makes one of the same kind.

Each folder holds a lock file its process keeps locked (flock) while it lives; the kernel drops the lock when the
process ends, however it ends. A process making a folder first removes the folders of its kind whose lock it can
take: their owners are gone. The lock, not a process id, says so, since ids are reused."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import tempfile
import threading
import weakref
from pathlib import Path

OWNER_LOCK = "owner.lock"
# The lock file's name until it is locked: a sweep never finds a folder's lock unlocked while its owner starts.
_UNLOCKED_OWNER_LOCK = "owner.lock.new"

# The folders of this process not yet removed, for a stop that ends the process without running its exit handlers
# (services.common.lifecycle's stop deadline).
_live_folders: set[Path] = set()
_live_folders_lock = threading.Lock()


class ScratchFolder:
    """A folder under the temporary directory named `prefix...`, owned by this process until `cleanup()` (or the
    interpreter's exit, or remove_live_scratch_folders)."""

    def __init__(self, prefix: str) -> None:
        remove_abandoned_scratch_folders(prefix)
        self.path = Path(tempfile.mkdtemp(prefix=prefix))
        unlocked = self.path / _UNLOCKED_OWNER_LOCK
        self._lock_file = open(unlocked, "w")  # noqa: SIM115 (held, locked, for the folder's life)
        fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(unlocked, self.path / OWNER_LOCK)
        with _live_folders_lock:
            _live_folders.add(self.path)
        self._finalizer = weakref.finalize(self, _remove, self.path, self._lock_file)

    @property
    def name(self) -> str:
        return str(self.path)

    def cleanup(self) -> None:
        self._finalizer()

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def _remove(path: Path, lock_file) -> None:
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        lock_file.close()
    with _live_folders_lock:
        _live_folders.discard(path)


def remove_live_scratch_folders() -> None:
    """Remove this process's scratch folders now: it is about to end without its exit handlers."""
    with _live_folders_lock:
        folders = list(_live_folders)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def remove_abandoned_scratch_folders(prefix: str) -> list[Path]:
    """Remove this user's folders named `prefix...` in the temporary directory whose owner has ended; the removed.
    Folders without a lock file (another program's, or a starting owner's) are left alone."""
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"{glob.escape(prefix)}*"):
        try:
            if folder.is_symlink() or not folder.is_dir() or folder.lstat().st_uid != os.getuid():
                continue
            lock_file = open(folder / OWNER_LOCK)  # noqa: SIM115 (closed below, after the folder is gone)
        except OSError:
            continue
        with lock_file:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: its owner lives
                continue
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
