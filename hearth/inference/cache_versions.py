"""Versions of one model in hearth's cache (a store publication's folder, a hub commit's) held while a process uses
them, and the others removed once no process on this machine does.

Each republish or new commit gets folders of its own (keyed by digest or commit), so without this every one stayed
forever. A process using a version holds a shared flock on the version's IN_USE_LOCK for as long as it runs (the
kernel releases it when the process ends, however it ends), since a running shard may read its folder again (a
reload, a changed range). Removal is conservative: a version is removed only by a process that has just written a
newer complete folder of the same model, only when it can take that lock exclusively without waiting (no process
holds it in use, this one included), and it is renamed aside before it is deleted, so no process sees it half
removed (one a process ending midway left aside is deleted by the next cleaning). A model-wide lock file (MODEL_LOCK)
orders taking a version into use and removing one, so a version is never taken into use while it is being removed;
removal skips a model another process is cleaning. A cache that refuses
these locks (read only, or a filesystem without flock) serves its versions unheld: nothing can remove them there.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from hearth.formats.cache_layout import IN_USE_LOCK, REMOVED_SUFFIX

from .errors import CheckpointError

logger = logging.getLogger(__name__)

MODEL_LOCK = ".versions.lock"
# How long taking a version into use waits for a process cleaning the same model (a few renames).
MODEL_LOCK_WAIT_S = 30.0
MODEL_LOCK_POLL_S = 0.05

# Version folder -> its IN_USE_LOCK, held open (and so locked) until this process ends.
_held: dict[Path, IO] = {}


def hold_version(model_dir: Path, version: Path) -> Path:
    """`version` (a folder directly inside `model_dir`), created if need be and held in use by this process until it
    ends; used unheld (a warning) where the cache refuses the lock. CheckpointError when another process keeps the
    model's lock past MODEL_LOCK_WAIT_S."""
    if version in _held:
        return version
    try:
        with folder_lock(model_dir, MODEL_LOCK, wait_s=MODEL_LOCK_WAIT_S):
            version.mkdir(parents=True, exist_ok=True)
            with contextlib.ExitStack() as on_error:
                handle = on_error.enter_context(open(version / IN_USE_LOCK, "a"))
                # Never blocks: a remover holds a version's lock exclusively only while it holds the model's lock.
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
                on_error.pop_all()  # held open (and so locked) until the process ends
            _held[version] = handle
    except BlockingIOError:  # a remover's: never, as removers lock the model first; used unheld it could vanish
        raise
    except OSError as error:  # a read-only cache, or no flock: a remover fails the same way, so none removes it
        logger.warning("using %s without marking it in use (%s): a process elsewhere with write access could "
                       "remove it meanwhile", version, error.strerror or error)
    return version


def remove_unused_versions(model_dir: Path, keep: set[Path]) -> list[str]:
    """Remove the folders of `model_dir` not in `keep` (nor named with a dot first) that no process holds in use;
    their names. Best effort: nothing when another process is cleaning the model, a folder it cannot lock is kept."""
    removed, aside = [], []
    try:
        with folder_lock(model_dir, MODEL_LOCK, wait_s=0.0):
            for folder in sorted(model_dir.iterdir()):
                if folder.name.startswith(".") and folder.name.endswith(REMOVED_SUFFIX) and folder.is_dir():
                    aside.append(folder)  # a removal cut short (or still under way: deleting it twice is harmless)
                    continue
                if folder.name.startswith(".") or folder in keep or not folder.is_dir() or folder in _held:
                    continue
                if (moved := _moved_aside_if_unused(folder)) is not None:
                    aside.append(moved)
                    removed.append(folder.name)
    except (CheckpointError, OSError) as error:  # busy, or a cache it cannot read: the next writer tries again
        logger.debug("not cleaning %s: %s", model_dir, error)
    return deleted_aside(aside, removed, f"unused cached version(s) of {model_dir}")


def deleted_aside(aside: list[Path], removed: list[str], what: str) -> list[str]:
    """Delete the folders moved `aside` (outside any lock: no process sees them any more) and log the `removed`
    names as `what`; those names."""
    for folder in aside:
        shutil.rmtree(folder, ignore_errors=True)
    if removed:
        logger.info("removed %d %s: %s", len(removed), what, ", ".join(removed))
    return removed


def is_held(version: Path) -> bool:
    """Whether this process holds `version` in use."""
    return version in _held


def release_version(version: Path) -> None:
    """Stop holding `version` in use (this process found nothing in it to use)."""
    if (handle := _held.pop(version, None)) is not None:
        handle.close()


def release_held_versions() -> None:
    """Release every version this process holds in use, as its end does (for tests standing in for processes)."""
    while _held:
        _held.popitem()[1].close()


def _moved_aside_if_unused(folder: Path) -> Path | None:
    try:
        handle = open(folder / IN_USE_LOCK, "a")  # noqa: SIM115 (closed below)
    except OSError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # a running process uses it
        aside = folder.with_name(f".{folder.name}.{os.getpid()}{REMOVED_SUFFIX}")
        os.rename(folder, aside)
        return aside


@contextlib.contextmanager
def folder_lock(folder: Path, lock_name: str, *, wait_s: float) -> Iterator[None]:
    """The lock file `lock_name` of `folder` held exclusively for the block; CheckpointError when another process
    keeps it past `wait_s`."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / lock_name, "a") as handle:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise CheckpointError(f"{folder} stayed locked by another process for {wait_s:.0f} s") \
                        from None
                time.sleep(MODEL_LOCK_POLL_S)
        yield  # released when the file is closed
