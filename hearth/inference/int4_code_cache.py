"""The disk cache of the int4 codes a CPU host rounds a checkpoint's weights into (weight_codes.int4_codes: each
group's range searched, which takes longer than reading the weight), so a host loading the same layers again reads
each weight's codes instead of reading it whole and rounding it again (BENCHMARKS.md, "Quantized shards: quality").

An entry is $HEARTH_CACHE_DIR (default ~/.cache/hearth)/int4-codes/<entry name>, one per checkpoint, dtype the
weights are read in and scheme, its name a digest of those (the checkpoint by its weight files' resolved paths and
file_versions) and of what decides the codes and their layout (this cache's format, int4's range steps, torch's
version and the CPU capability its kernels run at, which decide how torch packs them): a changed weight file, another
rounding, another torch or a cache folder shared with a host of another CPU make another entry, and the least
recently used entries beyond INT4_CODE_CACHE_MAX_ENTRIES are pruned. Each weight's codes, packed as torch's CPU kernel
takes them, are one safetensors file of its entry, written to a temporary name and renamed into place (processes
loading together never read a torn one); none is written where it would leave less than
INT4_CODE_CACHE_MIN_FREE_BYTES of the disk free. A cache that cannot be read or written only
costs the rounding, and a file that does not hold codes of the weight's shape and group size is taken for missing.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from hearth.formats.cache_layout import INT4_CODE_CACHE_DIR_NAME, hearth_cache_dir

from .file_version import file_version
from .gguf_cache import ENTRY_NAME_HEX_CHARS, STAGING_SUFFIX, create_entry
from . import weight_codes
from .weight_codes import KERNEL_DTYPE, Int4Codes

# Part of every entry's name: bumped whenever what an entry holds changes shape, or int4_grouped_codes rounds
# otherwise (as the mesh protocol is). 2: the codes packed as torch's CPU kernel takes them, not two to a byte.
INT4_CODE_CACHE_FORMAT = 2
# Entries kept, each the codes of the layers of one checkpoint a host loaded (under int4/g32 about a sixth of their
# float32 bytes).
INT4_CODE_CACHE_MAX_ENTRIES = 8
# The disk space a write leaves free at least: the cache gives way to what the host keeps there.
INT4_CODE_CACHE_MIN_FREE_BYTES = 1 << 30
_CODES, _TABLE = "packed_codes", "scales_and_zeros"
# A damaged, foreign or vanished file (a concurrent prune), or a folder that cannot be written: each means rounding.
CACHE_ERRORS = (OSError, ValueError, KeyError, RuntimeError, SafetensorError)


def int4_code_cache_root() -> Path:
    """Where entries live: $HEARTH_CACHE_DIR (default ~/.cache/hearth, as hearth/inference/checksum.py)/int4-codes."""
    return hearth_cache_dir() / INT4_CODE_CACHE_DIR_NAME


@dataclass(frozen=True)
class Int4CodeCache:
    """The cached codes of one checkpoint's weights, read in one dtype and rounded under one int4 scheme."""

    folder: Path
    about: str = ""  # what the entry holds codes of, for `hearth cache` (describe_entry)

    def codes(self, weight_name: str, shape: tuple[int, int], group_size: int) -> Int4Codes | None:
        """The codes stored for `weight_name` when they are of that shape and group size, else None."""
        try:
            tensors = load_file(self._file(weight_name))
            codes = Int4Codes(tensors[_CODES], tensors[_TABLE])
        except CACHE_ERRORS:
            return None
        rows, columns = shape
        if (codes.packed_codes.dtype != torch.uint8 or codes.scales_and_zeros.dtype != KERNEL_DTYPE
                or codes.shape != (rows, columns) or columns % group_size
                or tuple(codes.scales_and_zeros.shape) != (columns // group_size, rows, 2)):
            return None
        with contextlib.suppress(OSError):
            os.utime(self.folder)  # used: the last to be pruned
        # Copied out of the file's mapping: a shard's weights never depend on what later becomes of the file.
        return Int4Codes(codes.packed_codes.clone(), codes.scales_and_zeros.clone())

    def store(self, weight_name: str, codes: Int4Codes) -> None:
        """Keep `codes` as `weight_name`'s; a cache that cannot be written, or a disk near full, is left as it is."""
        tensors = {_CODES: codes.packed_codes.cpu().contiguous(), _TABLE: codes.scales_and_zeros.cpu().contiguous()}
        size = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        staging = None
        try:
            create_entry(self.folder, self.about, max_entries=INT4_CODE_CACHE_MAX_ENTRIES)
            if shutil.disk_usage(self.folder).free < size + INT4_CODE_CACHE_MIN_FREE_BYTES:
                return
            descriptor, staging = tempfile.mkstemp(dir=self.folder, prefix=f".{weight_name}.", suffix=STAGING_SUFFIX)
            os.close(descriptor)
            save_file(tensors, staging)
            os.replace(staging, self._file(weight_name))
        except BaseException as error:  # a failed write, or Ctrl-C while loading: no staging file left behind
            if staging is not None:
                with contextlib.suppress(OSError):
                    os.unlink(staging)
            if not isinstance(error, CACHE_ERRORS):
                raise

    def _file(self, weight_name: str) -> Path:
        return self.folder / f"{weight_name}.safetensors"



def int4_code_cache(weight_files: Iterable[Path], dtype: torch.dtype, scheme_label: str) -> Int4CodeCache | None:
    """The cache of the codes of a checkpoint's weights, held in `weight_files` as they are now, read in `dtype` and
    rounded under `scheme_label`; None when a file cannot be looked at."""
    try:
        files = [(path, *file_version(path.stat())) for path in sorted(Path(file).resolve() for file in weight_files)]
    except OSError:
        return None
    # The rounding's settings read as they are now: a scratch copy that changes them gets entries of its own.
    rounding = (weight_codes.INT4_RANGE_STEPS, weight_codes.INT4_RANGE_STEP)
    text = "\0".join(map(str, (INT4_CODE_CACHE_FORMAT, torch.__version__, torch.backends.cpu.get_cpu_capability(),
                               *rounding, dtype, scheme_label,
                               *(part for file in files for part in file))))
    name = hashlib.sha256(text.encode()).hexdigest()[:ENTRY_NAME_HEX_CHARS]
    parents = {path.parent for path, *_ in files}
    source = str(parents.pop()) if len(parents) == 1 and len(files) > 1 else ", ".join(str(path) for path, *_ in files)
    return Int4CodeCache(int4_code_cache_root() / name,
                         f"{scheme_label} codes of {source}, read in {str(dtype).removeprefix('torch.')}")
