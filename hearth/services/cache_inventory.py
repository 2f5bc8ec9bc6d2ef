"""What hearth keeps in its cache folder on this host (hearth/formats/cache_layout.py), entry by entry with its disk
use and whether a running process uses it, and the removal of entries: the body of `hearth cache`.

Each kind is a sub-folder of entries: `store` (models fetched from the community's object store, per name), `hub`
(parts of hub models fetched by layer range, per repository), `int4-codes` (codes a CPU host rounded, per checkpoint),
`gguf` (parsed GGUF metadata, per file version) and `random` (the `random:<shape>` checkpoints bench and tests write).
Every entry can be made again: a removed one costs the next start a fetch, a rounding or a parse. A store or hub
model's versions that a running process holds (hearth/inference/cache_versions.py's IN_USE_LOCK) are never removed;
the other kinds hold no locks, as their readers take a missing or vanished file for one never written, so an entry is
renamed aside before it is deleted and no reader sees it half removed. Light (no torch) but for removing store and hub
versions, which goes through cache_versions' own locking.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hearth.formats.cache_layout import GGUF_CACHE_DIR_NAME, HUB_PARTIAL_FOLDER, IN_USE_LOCK, \
    INT4_CODE_CACHE_DIR_NAME, RANDOM_MARKER_FILE, RANDOM_MODELS_FOLDER, REMOVED_SUFFIX, STORE_CACHE_FOLDER, \
    entry_description, hearth_cache_dir

# Each kind's name (what `hearth cache clear` takes) and its sub-folder, in the order they are listed.
CACHE_KINDS: dict[str, str] = {
    "store": STORE_CACHE_FOLDER,
    "hub": HUB_PARTIAL_FOLDER,
    "int4-codes": INT4_CODE_CACHE_DIR_NAME,
    "gguf": GGUF_CACHE_DIR_NAME,
    "random": RANDOM_MODELS_FOLDER,
}
# Kinds whose entries hold versions that running processes lock while they use them.
VERSIONED_KINDS = ("store", "hub")
# In a hub model's folder: which commit each revision names (hearth/inference/hub_fetch.py), not a version.
HUB_REFS_FOLDER = "refs"
PROC_LOCKS = Path("/proc/locks")
DISK_BLOCK_BYTES = 512


@dataclass(frozen=True)
class CacheEntry:
    """One entry of hearth's cache: `name` is what `hearth cache clear KIND NAME` takes; `in_use` is None for kinds
    no process marks (or where the kernel's lock table cannot be read)."""

    kind: str
    name: str
    folder: Path
    about: str
    size_bytes: int
    last_used: float
    in_use: bool | None


@dataclass(frozen=True)
class Removal:
    """What removing an entry did: the bytes freed, and how many of its versions were kept because a running process
    uses them (or another process was cleaning the same model)."""

    freed_bytes: int
    versions_kept: int


def cache_entries(kinds: Iterable[str] = CACHE_KINDS, root: Path | None = None) -> list[CacheEntry]:
    """The entries of `kinds` in hearth's cache folder (`root`, default $HEARTH_CACHE_DIR), each kind's by name."""
    root = root if root is not None else hearth_cache_dir()
    locked = locked_inodes()
    entries = []
    for kind in kinds:
        for folder in sorted(_entry_folders(root / CACHE_KINDS[kind], kind)):
            entries.append(CacheEntry(
                kind=kind, name=_entry_name(kind, folder), folder=folder, about=_about(kind, folder),
                size_bytes=disk_usage(folder), last_used=_last_used(folder),
                in_use=(any(_lock_identity(lock) in locked for lock in _version_locks(folder))
                        if kind in VERSIONED_KINDS and locked is not None else None)))
    return entries


def remove_entry(entry: CacheEntry) -> Removal:
    """Remove `entry` (a store or hub model: every version no running process uses); what that freed."""
    if entry.kind in VERSIONED_KINDS:
        # Imported here: the model side brings torch, which listing does without.
        from hearth.inference.cache_versions import remove_unused_versions

        remove_unused_versions(entry.folder, {entry.folder / HUB_REFS_FOLDER})
        kept = sum(1 for _ in _versions(entry.folder))
        if kept == 0:
            with contextlib.suppress(OSError):
                shutil.rmtree(entry.folder / HUB_REFS_FOLDER)  # names only commits removed now
        return Removal(max(0, entry.size_bytes - disk_usage(entry.folder)), kept)
    aside = entry.folder.with_name(f".{entry.folder.name}.{os.getpid()}{REMOVED_SUFFIX}")
    try:
        os.rename(entry.folder, aside)
    except FileNotFoundError:  # removed meanwhile (a prune, another `hearth cache clear`)
        return Removal(0, 0)
    shutil.rmtree(aside, ignore_errors=True)
    return Removal(entry.size_bytes, 0)


def leftovers(kinds: Iterable[str] = CACHE_KINDS, root: Path | None = None) -> list[Path]:
    """The folders a removal ending midway left renamed aside in `kinds`' folders (a store or hub model's own are
    deleted by its next cleaning)."""
    root = root if root is not None else hearth_cache_dir()
    return [aside for kind in kinds if (folder := root / CACHE_KINDS[kind]).is_dir()
            for aside in sorted(folder.glob(f".*{REMOVED_SUFFIX}")) if aside.is_dir()]


def remove_leftovers(kinds: Iterable[str] = CACHE_KINDS, root: Path | None = None) -> int:
    """Delete `leftovers(kinds)`; the bytes freed."""
    freed = 0
    for aside in leftovers(kinds, root):
        freed += disk_usage(aside)
        shutil.rmtree(aside, ignore_errors=True)
    return freed


def disk_usage(folder: Path) -> int:
    """Bytes of disk the files under `folder` take, each file once however many links name it."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for parent, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):  # a file removed while walking
                stat = os.lstat(os.path.join(parent, name))
                if (stat.st_dev, stat.st_ino) not in seen:
                    seen.add((stat.st_dev, stat.st_ino))
                    total += stat.st_blocks * DISK_BLOCK_BYTES
    return total


def locked_inodes() -> set[tuple[int, int, int]] | None:
    """(device major, minor, inode) of every file some process holds a lock on, from the kernel's lock table; None
    where it cannot be read. Read, not tested by locking: a test lock could fail a process taking its own."""
    try:
        lines = PROC_LOCKS.read_text().splitlines()
    except OSError:
        return None
    locked = set()
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->":  # a process waiting for a lock holds none
            continue
        with contextlib.suppress(ValueError):
            major, minor, inode = fields[5].split(":")
            locked.add((int(major, 16), int(minor, 16), int(inode)))
    return locked


def _lock_identity(path: Path) -> tuple[int, int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return os.major(stat.st_dev), os.minor(stat.st_dev), stat.st_ino


def _entry_folders(kind_folder: Path, kind: str) -> Iterator[Path]:
    if not kind_folder.is_dir():
        return
    for folder in kind_folder.iterdir():
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        if kind == "random" and not (folder / RANDOM_MARKER_FILE).is_file():
            continue  # a shape being written (its staging folder)
        if kind in VERSIONED_KINDS and next(_versions(folder), None) is None:
            continue  # every version removed: its lock file and refs are all that is left
        yield folder


def _versions(model_folder: Path) -> Iterator[Path]:
    """The version folders of a store or hub model (a publication's digest, a commit)."""
    for folder in model_folder.iterdir() if model_folder.is_dir() else ():
        if not folder.name.startswith(".") and folder.name != HUB_REFS_FOLDER and folder.is_dir():
            yield folder


def _version_locks(model_folder: Path) -> list[Path]:
    return [version / IN_USE_LOCK for version in _versions(model_folder)]


def _entry_name(kind: str, folder: Path) -> str:
    return folder.name.replace("--", "/", 1) if kind == "hub" else folder.name


def _about(kind: str, folder: Path) -> str:
    if kind == "store":
        return f"store:{folder.name} (fetched from the community's store)"
    if kind == "hub":
        commits = sum(1 for _ in _versions(folder))
        return f"{_entry_name(kind, folder)} (layer ranges fetched from the hub, {commits} commit(s))"
    if kind == "random":
        return f"random weights of the {folder.name} shape, for bench and tests"
    described = entry_description(folder)
    if described is not None:
        return described
    return "int4 codes (of a checkpoint not named)" if kind == "int4-codes" else "parsed GGUF metadata"


def _last_used(folder: Path) -> float:
    """The latest modification of the entry or anything directly in it (an int4 entry is touched when read)."""
    times = [time.time()]
    with contextlib.suppress(OSError):  # removed meanwhile: as good as just used
        times = [folder.stat().st_mtime, *(child.stat().st_mtime for child in folder.iterdir())]
    return max(times)
