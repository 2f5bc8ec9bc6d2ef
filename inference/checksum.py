"""weights_sha256: one digest over a checkpoint's weight files, cached by (path, size, mtime)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from .errors import CheckpointError

WEIGHTS_CACHE_DIR_ENV = "HEARTH_CACHE_DIR"
DEFAULT_WEIGHTS_CACHE_DIR = Path("~/.cache/hearth")
WEIGHTS_CACHE_FILE_NAME = "weights_sha256.json"
WEIGHTS_CACHE_MAX_ENTRIES = 64
HASH_CHUNK_BYTES = 8 << 20
WEIGHT_FILE_GLOB = "*.safetensors"


def weights_cache_file(cache_dir: str | Path | None = None) -> Path:
    """Where digests are cached: ``cache_dir``, else $HEARTH_CACHE_DIR, else ~/.cache/hearth."""
    base = cache_dir or os.environ.get(WEIGHTS_CACHE_DIR_ENV) or DEFAULT_WEIGHTS_CACHE_DIR
    return Path(base).expanduser() / WEIGHTS_CACHE_FILE_NAME


def weights_sha256(checkpoint_path: str | Path, *, cache_dir: str | Path | None = None) -> str:
    """Hex SHA-256 over every ``*.safetensors`` file of a checkpoint folder, in name order.

    Each file contributes its name, its size and its bytes, so renaming, truncating or changing any
    tensor changes the digest, while every shard host of the same checkpoint gets the same value
    whichever layers it loads. The result is cached under the folder's path together with each
    file's size and mtime; a later call with unchanged files reads no weight bytes at all.
    """
    folder = Path(checkpoint_path).expanduser().resolve()
    files = sorted(folder.glob(WEIGHT_FILE_GLOB), key=lambda f: f.name)
    if not files:
        raise CheckpointError(f"{folder} has no {WEIGHT_FILE_GLOB} weight files")
    # stat() follows hub-cache symlinks to their blobs, so a re-downloaded blob invalidates the entry.
    fingerprint = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    cache_file = weights_cache_file(cache_dir)
    cache = _read_cache(cache_file)
    entry = cache.get(str(folder))
    if entry and entry.get("files") == fingerprint:
        return entry["sha256"]
    digest = _digest(files)
    cache.pop(str(folder), None)
    cache[str(folder)] = {"files": fingerprint, "sha256": digest}
    while len(cache) > WEIGHTS_CACHE_MAX_ENTRIES:
        cache.pop(next(iter(cache)))
    _write_cache(cache_file, cache)
    return digest


def _digest(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0")
        digest.update(file.stat().st_size.to_bytes(8, "little"))
        with file.open("rb") as handle:
            while chunk := handle.read(HASH_CHUNK_BYTES):
                digest.update(chunk)
    return digest.hexdigest()


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
