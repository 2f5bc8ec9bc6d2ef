"""The exclusive lock a broker holds on its JetStream store folder while its nats-server runs: nats-server does not
lock the folder itself, and two servers writing one store corrupt it.

The lock is a flock on STORE_LOCK_NAME inside the folder, held by the process that starts nats-server and by the
nats-server itself (it inherits the locked file): the kernel drops it once both have ended, however they end, so a
crash leaves no stale lock. The file holds the starting process's id, to name it in a refusal; the lock, not the id,
says whether the folder is in use, since ids are reused."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

STORE_LOCK_NAME = "hearth-nats.lock"
# Far more than a process id takes: a file someone else wrote there is not read whole.
_holder_read_limit = 32


class StoreFolderInUse(RuntimeError):
    """Another broker (another process, or another server of this one) holds the store folder's lock."""


class StoreFolderLock:
    """The lock on one store folder, held from `take()` until `release()` (or this process's end)."""

    def __init__(self, store_dir: Path) -> None:
        self.store_dir = store_dir
        self.path = store_dir / STORE_LOCK_NAME
        self._file: IO[str] | None = None

    @property
    def fileno(self) -> int | None:
        """The locked file's descriptor, for the nats-server child to inherit (None while not held)."""
        return self._file.fileno() if self._file is not None else None

    def take(self) -> "StoreFolderLock":
        """Lock the folder (which must exist); StoreFolderInUse, naming the folder and the holder's process id
        when it is known, if another holds it. A filesystem without flock serves unguarded, with a warning."""
        if self._file is not None:
            return self
        lock_file = open(self.path, "a+")  # noqa: SIM115 (held, locked, while the broker runs); "a+": not emptied
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            lock_file.close()
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = _holder_pid(self.path)
                by = f" (held by process {holder})" if holder is not None else ""
                raise StoreFolderInUse(
                    f"the store folder {self.store_dir} is in use by another broker{by}; two nats-servers writing "
                    "one store corrupt it: stop that broker, or give this one another store folder") from None
            log.warning("cannot lock the store folder %s (%s): nothing keeps a second broker off it",
                        self.store_dir, error.strerror or error)
            return self
        lock_file.seek(0)
        lock_file.truncate()
        lock_file.write(f"{os.getpid()}\n")
        lock_file.flush()
        self._file = lock_file
        return self

    def release(self) -> None:
        """Close this process's hold; the lock goes once a nats-server that inherited it has ended too."""
        lock_file, self._file = self._file, None
        if lock_file is not None:
            with contextlib.suppress(OSError):
                lock_file.close()


def _holder_pid(path: Path) -> int | None:
    """The process id the lock's holder wrote (None: not yet written, or not an id)."""
    try:
        with open(path, "rb") as lock_file:
            text = lock_file.read(_holder_read_limit).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() and 0 < int(text) < 2**31 else None
