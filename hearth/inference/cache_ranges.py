"""Layer-range folders within one cached version of a model held while a process uses them, and the superseded ones
removed, with the fetched files only they needed, once no process on this machine does.

A host fetching a range of a hub or `store:` model gets a folder per selection ("layers-3-5", "head", "all") beside
a pool of fetched files those folders link to (a store's objects, a hub commit's files). cache_versions.py removes
only older versions: without this, every range a host served and left (it moved, or started again with another)
stayed in the current version for good. A process using a selection holds a shared flock on its lock file,
LOCK_ROOT/RANGES_FOLDER/SELECTION.in-use, from before it reads the folder or the pool until it releases it (a host that
moved) or ends; the lock file lives outside the selection's folder because a folder is renamed into place whole.
A process that has just written a selection's folder then removes, under the lock root's RANGES_LOCK (which taking a
hold also takes, so nothing is taken into use while removed), every selection folder no process holds and the pool
files that no held selection needs; a selection held while still being fetched keeps the files it needs. A cache
that refuses these locks serves its folders unheld and removes nothing, as cache_versions.py does.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

from hearth.formats.cache_layout import REMOVED_SUFFIX

from .cache_versions import MODEL_LOCK_WAIT_S, deleted_aside, folder_lock
from .errors import CheckpointError
from .partial_checkpoint import NeededTensors, complete_partial_folder, remove_abandoned

logger = logging.getLogger(__name__)

RANGES_FOLDER = ".ranges"
RANGES_LOCK = ".ranges.lock"
IN_USE_SUFFIX = ".in-use"
SELECTION_NAME = re.compile(r"^(all|head|layers-(\d+)-(\d+))$")

# A selection's folder (as fetched) -> its lock file, held open (and so locked) until released or the process ends.
_held: dict[Path, IO] = {}


def needed_of(selection: str) -> NeededTensors:
    """What a selection folder's name (partial_checkpoint.selection_name) asks for; ValueError for another name."""
    found = SELECTION_NAME.match(selection)
    if found is None:
        raise ValueError(f"{selection!r} names no selection")
    if found.group(2) is None:
        return None if selection == "all" else "head"
    return int(found.group(2)), int(found.group(3))


def hold_range(lock_root: Path, folder: Path) -> None:
    """Hold the selection `folder` (named as partial_checkpoint.selection_name names it) of the version `lock_root`
    in use by this process until release_range(folder) or its end; unheld (a warning) where the cache refuses the
    lock. CheckpointError when another process keeps the lock root's lock past MODEL_LOCK_WAIT_S."""
    key = folder.resolve()
    if key in _held:
        return
    try:
        with folder_lock(lock_root, RANGES_LOCK, wait_s=MODEL_LOCK_WAIT_S):
            (lock_root / RANGES_FOLDER).mkdir(exist_ok=True)
            with contextlib.ExitStack() as on_error:
                handle = on_error.enter_context(open(_lock_file(lock_root, folder.name), "a"))
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a remover locks it only under RANGES_LOCK
                on_error.pop_all()
            _held[key] = handle
    except OSError as error:  # a read-only cache, or no flock: a remover fails the same way
        logger.warning("using %s without marking it in use (%s): a process elsewhere with write access could "
                       "remove it meanwhile", folder, error.strerror or error)


def held_complete_folder(lock_root: Path, folder: Path) -> Path | None:
    """The selection `folder` of `lock_root`, held in use, when it is complete (partial_checkpoint's marker); else
    None, and not held unless it was."""
    held_before = is_range_held(folder)
    hold_range(lock_root, folder)  # before it is read: no cleaning process removes it then
    if (done := complete_partial_folder(folder)) is None and not held_before:
        release_range(folder)
    return done


def release_range(path: Path) -> None:
    """Stop holding the selection folder `path` (or the folder of the GGUF file `path`) in use: this process no
    longer serves it (a host that moved to another range)."""
    for key in (path.resolve(), path.resolve().parent):
        if (handle := _held.pop(key, None)) is not None:
            handle.close()
            return


def is_range_held(folder: Path) -> bool:
    """Whether this process holds the selection `folder` in use."""
    return folder.resolve() in _held


def release_held_ranges() -> None:
    """Release every selection this process holds, as its end does (for tests standing in for processes)."""
    while _held:
        _held.popitem()[1].close()


def remove_superseded_ranges(lock_root: Path, parents: Iterable[Path], pool: Path | None,
                             files_of: Callable[[NeededTensors], set[str]], *, written: str | None) -> list[str]:
    """Remove the selection folders in `parents` that no process holds, and the files of `pool` that `files_of`
    (the pool files a selection needs; of None, every one a selection may need) names for no held selection, the
    selection just `written` (if any) counted as held; the names of the folders removed. Best effort: nothing when
    another process is cleaning, or the cache refuses."""
    removed, aside = [], []
    try:
        with folder_lock(lock_root, RANGES_LOCK, wait_s=0.0):
            held = _held_selections(lock_root) | ({written} if written is not None else set())
            for parent in parents:
                for folder in sorted(parent.iterdir()) if parent.is_dir() else ():
                    if SELECTION_NAME.match(folder.name) and folder.name not in held and folder.is_dir():
                        aside.append(folder.rename(folder.with_name(f".{folder.name}.{os.getpid()}{REMOVED_SUFFIX}")))
                        removed.append(folder.name)
            if pool is not None and pool.is_dir():
                needed = set().union(*(files_of(needed_of(selection)) for selection in held))
                for name in sorted(files_of(None) - needed):
                    (pool / name).unlink(missing_ok=True)
    except (CheckpointError, OSError) as error:  # busy, or a cache it cannot change: the next writer tries again
        logger.debug("not cleaning the ranges of %s: %s", lock_root, error)
    for folder in (*parents, *([pool] if pool is not None else [])):  # what processes died writing
        with contextlib.suppress(OSError):
            remove_abandoned(folder)
    return deleted_aside(aside, removed, f"unused layer range folder(s) of {lock_root}")


def _held_selections(lock_root: Path) -> set[str]:
    """The selections of `lock_root` some process holds (this one included); lock files of the others removed."""
    held = set()
    for lock_file in sorted((lock_root / RANGES_FOLDER).glob(f"*{IN_USE_SUFFIX}")):
        selection = lock_file.name[:-len(IN_USE_SUFFIX)]
        if not SELECTION_NAME.match(selection):
            continue
        with open(lock_file, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held.add(selection)
                continue
            lock_file.unlink()  # no holder can open it meanwhile: holds are taken under RANGES_LOCK, held here
    return held


def _lock_file(lock_root: Path, selection: str) -> Path:
    return lock_root / RANGES_FOLDER / f"{selection}{IN_USE_SUFFIX}"
