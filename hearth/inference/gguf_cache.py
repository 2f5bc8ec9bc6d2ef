"""The disk cache of what hearth parses from a GGUF file (its HF config, tensor table and tokenizer, and the demo's
description of it), one folder per file version, so a process starting on an unchanged GGUF reads a few small
files instead of parsing the GGUF's metadata again (seconds for a real vocabulary: BENCHMARKS.md, "GGUF start-up").

An entry lives in $HEARTH_CACHE_DIR (default ~/.cache/hearth)/gguf/<entry name>, the name a digest of the file's
resolved path and version (file_version: its device and inode, size, mtime and ctime): a changed file has a new
entry, the old one is pruned with the least recently written beyond GGUF_CACHE_MAX_ENTRIES. Every artifact is written
to a temporary name and renamed into place, so processes starting together (a demo's shards and head) never read a
torn one, and a cache folder that cannot be written only costs the next process the same parse.
hearth/services/devtools/demo_model.py writes its description into the same entry without importing this module (it
stays free of torch): keep ``gguf_cache_entry_name`` in step with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hearth.formats.cache_layout import GGUF_CACHE_DIR_NAME, describe_entry, hearth_cache_dir

from .file_version import FileVersion, file_version

# Part of every entry's name: bumped whenever what an entry holds changes shape or what parsing refuses, so no
# process misreads an old one or serves a file it now refuses (6: named by file_version, not size and mtime alone).
GGUF_CACHE_FORMAT = 6
# File versions kept; each holds a tokenizer (a few MB for a real vocabulary).
GGUF_CACHE_MAX_ENTRIES = 16
ENTRY_NAME_HEX_CHARS = 32
STAGING_SUFFIX = ".tmp"
# Raised by a damaged or vanished artifact (a concurrent prune), or a value json cannot hold: each means a re-parse.
CACHE_ERRORS = (OSError, ValueError, TypeError, KeyError)


def gguf_cache_root() -> Path:
    """Where entries live: $HEARTH_CACHE_DIR (default ~/.cache/hearth, as hearth/inference/checksum.py)/gguf."""
    return hearth_cache_dir() / GGUF_CACHE_DIR_NAME


def gguf_cache_entry_name(path: Path, version: FileVersion) -> str:
    """The entry folder name of one version of the GGUF at resolved `path`."""
    text = "\0".join(map(str, (GGUF_CACHE_FORMAT, path, *version)))
    return hashlib.sha256(text.encode()).hexdigest()[:ENTRY_NAME_HEX_CHARS]


@dataclass(frozen=True)
class GGUFCacheEntry:
    """The cached artifacts of one GGUF file version: JSON values and saved folders, each by name."""

    folder: Path
    about: str = ""  # which file's metadata the entry holds, for `hearth cache` (describe_entry)

    def read_json(self, name: str):
        """The value stored under `name`, None when there is none (or it is unreadable)."""
        try:
            return json.loads((self.folder / f"{name}.json").read_text())
        except CACHE_ERRORS:
            return None

    def write_json(self, name: str, value) -> None:
        """Store `value` (JSON-serialisable) under `name`; a cache that cannot be written is left as it is."""
        try:
            text = json.dumps(value)
            self._create()
            descriptor, staging = tempfile.mkstemp(dir=self.folder, prefix=f".{name}.", suffix=STAGING_SUFFIX)
        except CACHE_ERRORS:
            return
        try:
            with os.fdopen(descriptor, "w") as handle:
                handle.write(text)
            os.replace(staging, self.folder / f"{name}.json")
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(staging)

    def saved_folder(self, name: str) -> Path | None:
        """The complete folder saved under `name`, None when there is none."""
        folder = self.folder / name
        return folder if folder.is_dir() else None

    def save_folder(self, name: str, save: Callable[[Path], object]) -> None:
        """Have `save(folder)` fill a new folder, then put it in place under `name` whole; the first process to
        finish wins, and a failure only leaves the entry without it."""
        if self.saved_folder(name) is not None:
            return
        try:
            self._create()
            staging = Path(tempfile.mkdtemp(dir=self.folder, prefix=f".{name}.", suffix=STAGING_SUFFIX))
        except OSError:
            return
        try:
            save(staging)
            os.rename(staging, self.folder / name)  # fails when another process put its folder there first
        except CACHE_ERRORS:
            pass
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    @contextlib.contextmanager
    def parsing(self, name: str) -> Iterator[None]:
        """Held while this process parses what it will store under `name`: processes starting together on one
        file (a demo's shards and head) parse it once, the others then read the result. Without a writable cache
        it holds nothing."""
        try:
            self._create()
            lock = open(self.folder / f".{name}.lock", "a")  # noqa: SIM115 (held across the yield)
        except OSError:
            yield
            return
        with lock:
            with contextlib.suppress(OSError):
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed, or the process ends
            yield

    def discard_folder(self, name: str) -> None:
        """Remove the folder saved under `name` (moved aside first, so no process sees it half removed)."""
        aside = self.folder / f".{name}.{os.getpid()}.discarded{STAGING_SUFFIX}"
        try:
            os.rename(self.folder / name, aside)
        except OSError:
            return
        shutil.rmtree(aside, ignore_errors=True)

    def _create(self) -> None:
        create_entry(self.folder, self.about, max_entries=GGUF_CACHE_MAX_ENTRIES)


def gguf_cache_entry(path: str | Path) -> GGUFCacheEntry:
    """The cache entry of the GGUF file at `path` as it is now (its resolved path and file_version)."""
    path = Path(path).resolve()
    return GGUFCacheEntry(gguf_cache_root() / gguf_cache_entry_name(path, file_version(path.stat())),
                          f"the metadata of {path}")


def create_entry(folder: Path, about: str, *, max_entries: int) -> None:
    """Make the entry `folder` unless it is there, described as `about` (for `hearth cache`), and prune its cache's
    entries beyond the `max_entries` most recently written."""
    if folder.is_dir():
        return
    folder.mkdir(parents=True, exist_ok=True)
    describe_entry(folder, about)
    prune_entries(folder.parent, keep=folder, max_entries=max_entries)


def prune_entries(root: Path, *, keep: Path, max_entries: int) -> None:
    """Remove the entry folders of `root` least recently written (or touched) beyond `max_entries` (never `keep`)."""
    try:
        entries = [(entry.stat().st_mtime_ns, entry) for entry in root.iterdir() if entry.is_dir()]
    except OSError:
        return
    entries.sort(reverse=True)
    for _, entry in entries[max_entries:]:
        if entry != keep:
            shutil.rmtree(entry, ignore_errors=True)
