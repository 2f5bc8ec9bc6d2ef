"""Which tensors a layer range or the head needs, and a loadable folder made from only the files that hold them.

A shard host serving layers lo..hi needs only the decoder layers' tensors in that range; an orchestrator's head only
the rest (embedding, final norm, lm_head). A partial folder links the fetched files, lists only their tensors in its
``model.safetensors.index.json`` (so SafetensorsCheckpoint and the memory estimate see exactly what is there) and
states the whole checkpoint's digest in its PARTIAL_CHECKPOINT_MARKER (so hosts holding different ranges of one
checkpoint advertise the same weights_sha256). The marker is written last: a folder without it is incomplete.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Literal, Union

from .checkpoint_files import SAFETENSORS_INDEX_NAME
from .checksum import PARTIAL_CHECKPOINT_MARKER
from .errors import CheckpointError

logger = logging.getLogger(__name__)

# What a caller needs: decoder layers lo..hi (inclusive), "head" (every tensor outside the decoder layers), or
# None for the whole checkpoint.
NeededTensors = Union[tuple[int, int], Literal["head"], None]
LAYER_TENSOR_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Files besides the weights that loading, tokenizing and chat templates read.
NON_WEIGHT_PATTERNS = ("*.json", "*.model", "*.txt", "*.jinja", "tokenizer*")
# What a process is still writing into the cache (a fetched object, a staged folder): named with a dot first and
# this suffix, and locked by its writer for as long as it writes. One no process locks that has not changed for
# ABANDONED_AFTER_S was left by a process that died writing it (a host killed mid-fetch): remove_abandoned removes
# it. The age covers the moment between a writer creating its file and locking it.
BEING_WRITTEN_SUFFIX = ".writing"  # not hub_download.PARTIAL_SUFFIX: a hub download resumes its part, this restarts
ABANDONED_AFTER_S = 60.0


def layer_of(tensor_name: str) -> int | None:
    """The decoder layer a tensor belongs to, or None for the embedding, final norm, head and the like."""
    found = LAYER_TENSOR_RE.search(tensor_name)
    return int(found.group(1)) if found else None


def check_needed(needed: NeededTensors) -> NeededTensors:
    """`needed` itself, or CheckpointError naming what is malformed."""
    if needed is None or needed == "head":
        return needed
    if (isinstance(needed, tuple) and len(needed) == 2 and all(isinstance(bound, int) for bound in needed)
            and 0 <= needed[0] <= needed[1]):
        return needed
    raise CheckpointError(f"needed tensors must be (lo, hi) with 0 <= lo <= hi, 'head' or None, not {needed!r}")


def is_needed(tensor_name: str, needed: NeededTensors) -> bool:
    """Whether a tensor is part of what `needed` asks for."""
    if needed is None:
        return True
    layer = layer_of(tensor_name)
    if needed == "head":
        return layer is None
    return layer is not None and needed[0] <= layer <= needed[1]


def selection_name(needed: NeededTensors) -> str:
    """A folder name for `needed`: "layers-3-5", "head" or "all"."""
    if needed is None:
        return "all"
    if needed == "head":
        return "head"
    return f"layers-{needed[0]}-{needed[1]}"


def files_holding(weight_map: Mapping[str, str], needed: NeededTensors) -> set[str]:
    """The weight files of an index's `weight_map` (tensor -> file) that hold a tensor `needed` asks for."""
    return {file for name, file in weight_map.items() if is_needed(name, needed)}


def complete_partial_folder(folder: Path) -> Path | None:
    """`folder` when a finished partial folder is there (its marker written) and each file its marker lists still
    has the size it was assembled with, else None: a file damaged since (truncated by a full disk or a crash) makes
    the caller fetch it again instead of loading it."""
    marker = folder / PARTIAL_CHECKPOINT_MARKER
    if not marker.is_file():
        return None
    try:
        sizes = json.loads(marker.read_text()).get("sizes") or {}  # none in a marker written before sizes were
        damaged = [name for name, size in sizes.items() if _size_of(folder / name) != size]
    except (OSError, ValueError, AttributeError):
        return None
    if damaged:
        logger.warning("%s: %s is not the size it was fetched with (damaged?): fetching it again", folder, damaged[0])
        return None
    return folder


def _size_of(file: Path) -> int | None:
    try:
        return file.stat().st_size  # through a link, the fetched file's
    except OSError:
        return None


def partial_source(folder: Path) -> str | None:
    """What the partial folder `folder` was fetched from, as its marker names it ("a checkpoint" when unreadable);
    None when `folder` is no partial folder."""
    marker = folder / PARTIAL_CHECKPOINT_MARKER
    if not marker.is_file():
        return None
    try:
        source = json.loads(marker.read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        source = None
    return source[:200] if isinstance(source, str) and source.isprintable() else "a checkpoint"


def written_marker(folder: Path, *, weights_sha256: str, source: str) -> None:
    """Write `folder`'s PARTIAL_CHECKPOINT_MARKER naming `source` and the whole checkpoint's digest, with the size of
    each file the folder holds (complete_partial_folder checks them before the folder is reused)."""
    sizes = {file.name: file.stat().st_size for file in sorted(folder.iterdir())
             if file.is_file() and not file.name.startswith(".")}  # not a download's lock or partial file
    marker = {"source": source, "weights_sha256": weights_sha256, "sizes": sizes}
    (folder / PARTIAL_CHECKPOINT_MARKER).write_text(json.dumps(marker))


def assemble_partial_folder(target: Path, files: Mapping[str, Path], weight_map: Mapping[str, str] | None,
                            *, weights_sha256: str, source: str) -> Path:
    """Make `target` a loadable folder: a link to each of `files` (name in the folder -> fetched file), the index
    restricted to the tensors of the linked weight files (none written when `weight_map` is None: the loader then
    reads the linked files' own headers), and the marker naming `source` and the whole checkpoint's digest.

    Built beside `target` and renamed into place, so two hosts assembling the same selection at once both end up
    with a complete folder."""
    if (done := complete_partial_folder(target)) is not None:
        return done
    with staged_partial_folder(target, weights_sha256=weights_sha256, source=source) as staging:
        for name, file in files.items():
            (staging / name).symlink_to(Path(file).resolve())
        if weight_map is not None:
            present = {name: file for name, file in weight_map.items() if file in files}
            index = {"metadata": {"hearth_partial_of": source}, "weight_map": present}
            (staging / SAFETENSORS_INDEX_NAME).unlink(missing_ok=True)
            (staging / SAFETENSORS_INDEX_NAME).write_text(json.dumps(index, indent=1, sort_keys=True))
    return target


@contextlib.contextmanager
def staged_partial_folder(target: Path, *, weights_sha256: str, source: str) -> Iterator[Path]:
    """A folder beside `target` for the caller to fill; when the block ends without error, the marker naming
    `source` and the whole checkpoint's digest is written into it and it is renamed into place (a complete folder a
    concurrent twin put there first is kept, a stale unfinished one replaced). Removed whatever happens."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", suffix=BEING_WRITTEN_SUFFIX, dir=target.parent))
    try:
        with locked_while_written(staging):
            yield staging
            written_marker(staging, weights_sha256=weights_sha256, source=source)
            try:
                os.replace(staging, target)
            except OSError:
                if complete_partial_folder(target) is None:  # not a concurrent twin: a stale, unfinished folder
                    shutil.rmtree(target, ignore_errors=True)
                    os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def locked_while_written(path: Path) -> Iterator[None]:
    """Hold `path` (a file or folder named with a dot first and BEING_WRITTEN_SUFFIX) locked for the block, so that
    remove_abandoned leaves it to this writer."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)  # only a remover's check holds it, and only for a moment
        yield
    finally:
        os.close(descriptor)


def remove_abandoned(folder: Path) -> list[str]:
    """Remove the files and folders in `folder` that a process died writing (BEING_WRITTEN_SUFFIX, locked by no
    process, unchanged for ABANDONED_AFTER_S); their names. Best effort: one it cannot lock or remove is left."""
    removed = []
    for entry in sorted(folder.iterdir()) if folder.is_dir() else ():
        if not (entry.name.startswith(".") and entry.name.endswith(BEING_WRITTEN_SUFFIX)):
            continue
        try:
            descriptor = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while its writer writes
            if time.time() - os.fstat(descriptor).st_mtime >= ABANDONED_AFTER_S:
                if entry.is_dir():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
                removed.append(entry.name)
        except OSError:
            continue
        finally:
            os.close(descriptor)
    if removed:
        logger.info("removed %d file(s) a process died writing in %s: %s", len(removed), folder, ", ".join(removed))
    return removed

