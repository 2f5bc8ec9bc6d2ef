"""weights_sha256: one digest over a checkpoint's weight files (or its GGUF file), cached by each file's version
(file_version: its inode, size, mtime and ctime)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from .errors import CheckpointError
from .file_version import file_version
from .heap import release_freed_heap
from hearth.formats.cache_layout import DEFAULT_WEIGHTS_CACHE_DIR, WEIGHTS_CACHE_DIR_ENV
from hearth.formats.gguf_support import is_gguf_file

# v2: the digest combines each file's own SHA-256, so a partial copy can state it from its source's listing.
# v3: each file keyed by file_version, not its size and mtime alone (a v2 file's entries would never match).
WEIGHTS_CACHE_FILE_NAME = "weights_sha256.v3.json"
WEIGHTS_CACHE_MAX_ENTRIES = 64
HASH_CHUNK_BYTES = 8 << 20
# Hashing a file this large shows a progress bar: a weight file, tens of seconds to minutes for a large model's.
HASH_PROGRESS_MIN_BYTES = 256 << 20
WEIGHT_FILE_GLOB = "*.safetensors"
# The name a GGUF file is hashed under instead of its own: a renamed copy is still the same weights.
GGUF_DIGEST_NAME = "model.gguf"
# Written by hearth/inference/partial_checkpoint.py into a folder holding only part of a checkpoint: the whole one's
# digest.
PARTIAL_CHECKPOINT_MARKER = "hearth-partial-checkpoint.json"


def weights_cache_file(cache_dir: str | Path | None = None) -> Path:
    """Where digests are cached: ``cache_dir``, else $HEARTH_CACHE_DIR, else ~/.cache/hearth."""
    base = cache_dir or os.environ.get(WEIGHTS_CACHE_DIR_ENV) or DEFAULT_WEIGHTS_CACHE_DIR
    return Path(base).expanduser() / WEIGHTS_CACHE_FILE_NAME


def weights_sha256(checkpoint_path: str | Path, *, cache_dir: str | Path | None = None) -> str:
    """Hex SHA-256 over every ``*.safetensors`` file of a checkpoint folder, in name order, or over a GGUF file.

    Each file contributes its name, its size and its bytes, so renaming, truncating or changing any
    tensor changes the digest, while every shard host of the same checkpoint gets the same value
    whichever layers it loads. A GGUF file counts as one weight file named GGUF_DIGEST_NAME, so hosts holding
    the same file under different names agree. A folder holding only part of a checkpoint (a layer range
    fetched from the hub or the community's store) states the whole checkpoint's digest in its
    PARTIAL_CHECKPOINT_MARKER, as does the folder of a GGUF written from part of one (hearth/inference/gguf_parts.py).
    The result is cached under the folder's path together with each file's version (file_version: its device and
    inode, size, mtime and ctime); a later call with unchanged files reads no weight bytes at all.
    """
    folder = Path(checkpoint_path).expanduser().resolve()
    gguf = is_gguf_file(folder)
    marker = (folder.parent if gguf else folder) / PARTIAL_CHECKPOINT_MARKER
    if marker.is_file():
        return _partial_digest(marker)
    files = [folder] if gguf else sorted(folder.glob(WEIGHT_FILE_GLOB), key=lambda f: f.name)
    if not files:
        raise CheckpointError(f"{folder} has no {WEIGHT_FILE_GLOB} weight files")
    # stat() follows hub-cache symlinks to their blobs, so a re-downloaded blob invalidates the entry.
    fingerprint = [[f.name, *file_version(f.stat())] for f in files]
    cache_file = weights_cache_file(cache_dir)
    cache = _read_cache(cache_file)
    entry = cache.get(str(folder))
    if entry and entry.get("files") == fingerprint:
        return entry["sha256"]
    digest = _digest(files, name_files=not gguf)
    release_freed_heap()  # on this thread: its arena's top holds the chunks it read (heap.py)
    cache.pop(str(folder), None)
    cache[str(folder)] = {"files": fingerprint, "sha256": digest}
    while len(cache) > WEIGHTS_CACHE_MAX_ENTRIES:
        cache.pop(next(iter(cache)))
    _write_cache(cache_file, cache)
    return digest


def digest_of_files(entries: Iterable[tuple[str, int, str]]) -> str:
    """The checkpoint digest from each weight file's (name, size in bytes, hex SHA-256), in name order."""
    digest = hashlib.sha256()
    for name, size, file_sha256 in sorted(entries):
        digest.update(name.encode() + b"\0")
        digest.update(size.to_bytes(8, "little"))
        digest.update(bytes.fromhex(file_sha256))
    return digest.hexdigest()


def file_sha256(file: Path) -> str:
    """Hex SHA-256 of one file's bytes, with a progress bar for a file of at least HASH_PROGRESS_MIN_BYTES."""
    from .hub_download import byte_progress

    digest = hashlib.sha256()
    with file.open("rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        with byte_progress(size, f"hashing {file.name}", shown=size >= HASH_PROGRESS_MIN_BYTES) as bar:
            while chunk := handle.read(HASH_CHUNK_BYTES):
                digest.update(chunk)
                bar.update(len(chunk))
    return digest.hexdigest()


def _digest(files: list[Path], *, name_files: bool = True) -> str:
    return digest_of_files(
        (file.name if name_files else GGUF_DIGEST_NAME, file.stat().st_size, file_sha256(file)) for file in files
    )


def _partial_digest(marker: Path) -> str:
    try:
        digest = json.loads(marker.read_text())["weights_sha256"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{marker} is unreadable: {error}") from None
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise CheckpointError(f"{marker} holds no SHA-256 digest")
    return digest


def _read_cache(cache_file: Path) -> dict:
    try:
        loaded = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _write_cache(cache_file: Path, cache: dict) -> None:
    # Atomic replace: concurrent shard hosts on one machine may race, and a torn file must never be read.
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=cache_file.parent, delete=False, suffix=".tmp") as tmp:
            json.dump(cache, tmp)
        os.replace(tmp.name, cache_file)
    except OSError:
        pass  # a read-only home only costs a re-hash next time
