"""How much disk a broker's JetStream store may take (its `max_file_store`), and the watch that names a store whose
disk filled anyway (another program filled it) and restarts its nats-server once the disk has room again."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

MiB = 1024 * 1024
# The store may take what it holds plus this share of its disk's free space at start (nats-server's own default
# share, which however counts the free space alone: a restart on a fuller disk then bounds the store below what it
# already holds). The rest is left to the machine's other programs.
store_share_of_free_space = 0.75
# A nats-server whose store met a full disk stores nothing more on that stream (or runs without JetStream) until it
# restarts: the broker restarts it by itself once the store's disk has this much free again.
room_to_restart_bytes = 64 * MiB
# A disk with less free than this is full: the next write of the store fails (and its log line may be lost).
full_disk_bytes = 1 * MiB
# What nats-server logs when a write to its store failed for want of space.
_OUT_OF_SPACE_SIGNS = ("no space left on device", "out of space", "out of resources, will be DISABLED")
# The most of the server's log one look reads (a flood is skipped over, not held in memory).
_max_log_read_bytes = 1 * MiB


def free_bytes(folder: Path) -> int:
    """What the disk holding `folder` has free for an unprivileged writer."""
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize


def bytes_held(folder: Path) -> int:
    """What the files under `folder` take on disk (0 when it does not exist yet)."""
    held = 0
    for directory, _, files in os.walk(folder):
        for name in files:
            try:
                held += os.lstat(os.path.join(directory, name)).st_blocks * 512
            except OSError:  # removed while we walked
                continue
    return held


def store_bound_bytes(store_dir: Path, jetstream_dir: Path) -> int:
    """The broker's `max_file_store`: what `jetstream_dir` holds plus store_share_of_free_space of the free space of
    the disk `store_dir` (an existing folder) is on."""
    return bytes_held(jetstream_dir) + int(free_bytes(store_dir) * store_share_of_free_space)


def streams_reserve_bytes() -> int:
    """What hearth's event streams and the call-nonce bucket reserve in a broker's store together (their max_bytes):
    a store bounded below it cannot hold them."""
    from hearth.events.streams import STREAM_SPECS
    from hearth.services.common.call_nonces import call_nonces_max_bytes

    return sum(spec.max_bytes for spec in STREAM_SPECS) + call_nonces_max_bytes


def warn_when_streams_do_not_fit(store_dir: Path, bound: int) -> None:
    """One WARNING at a broker's start when its store is bounded below what hearth's streams reserve."""
    needed = streams_reserve_bytes()
    if bound < needed:
        log.warning("the broker's store %s may take %d MiB (what it holds plus %d%% of its disk's free space), below "
                    "the %d MiB hearth's event streams reserve: they cannot be created there; free space on that disk "
                    "(or give the broker another --store) and restart it", store_dir, bound // MiB,
                    round(store_share_of_free_space * 100), needed // MiB)


class RestartableServer(Protocol):
    """What the watch needs of a broker (server.py's EmbeddedNatsServer): its store folder, and a restart."""

    store_dir: Path

    def restart(self) -> None: ...


class FullStoreWatch:
    """Reads a running nats-server's log for a write its store's full disk refused: says so in one ERROR, then
    restarts the server once the disk has `room_to_restart` bytes free again (its clients reconnect by themselves)."""

    def __init__(self, server: RestartableServer, *, room_to_restart: int = room_to_restart_bytes) -> None:
        self.server = server
        self.room_to_restart = room_to_restart
        self.full_since: float | None = None  # monotonic time the full disk was seen; None: not seen
        self._log_offset = self._log_size()

    @property
    def _log_path(self) -> Path:
        return self.server.store_dir / "nats-server.log"

    def _log_size(self) -> int:
        try:
            return self._log_path.stat().st_size
        except OSError:
            return 0

    def _new_log_text(self) -> str:
        """Whole lines the server logged since the last look."""
        try:
            with open(self._log_path, "rb") as log_file:
                log_file.seek(self._log_offset)
                said = log_file.read(_max_log_read_bytes)
        except OSError:
            return ""
        whole = said[:said.rfind(b"\n") + 1] if len(said) < _max_log_read_bytes else said
        self._log_offset += len(whole)
        return whole.decode(errors="replace")

    def _room(self) -> int | None:
        try:
            return free_bytes(self.server.store_dir)
        except OSError:
            return None

    def check(self) -> None:
        """One look (the broker's serve loop calls it every half second)."""
        said, room = self._new_log_text(), self._room()
        if self.full_since is None:
            # The log is on the store's disk too: on a disk full to the byte the server's lines are lost.
            if any(sign in said for sign in _OUT_OF_SPACE_SIGNS) or (room is not None and room < full_disk_bytes):
                self.full_since = time.monotonic()
                log.error("the broker's JetStream store %s met a full disk (%d KiB free): it takes no events until "
                          "nats-server restarts, which it does by itself once that disk has %d MiB free again",
                          self.server.store_dir, (room or 0) // 1024, self.room_to_restart // MiB)
            return
        if room is None or room < self.room_to_restart:
            return
        log.warning("the broker's store %s has %d MiB free again after %.0f s: restarting nats-server, its clients "
                    "reconnect", self.server.store_dir, room // MiB, time.monotonic() - self.full_since)
        try:
            self.server.restart()
        except RuntimeError as error:  # it did not start: the serve loop sees it gone and says so
            log.error("restarting nats-server on %s: %s", self.server.store_dir, error)
        self.full_since = None
        self._log_offset = self._log_size()
