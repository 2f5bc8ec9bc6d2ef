"""What tells one version of a file from another without reading a byte of it: the key of every cache of what hearth
derives from a weight file (its digest, a GGUF's parsed header, config and tensor table)."""

from __future__ import annotations

import os

FileVersion = tuple[int, int, int, int, int]


def file_version(stat: os.stat_result) -> FileVersion:
    """(device, inode, size, mtime_ns, ctime_ns) of a file's `stat`.

    Size and mtime alone miss a file rewritten in place at the same size within the clock's granularity, or with
    its mtime set back (`cp -p`, `touch -r`, `rsync -t`); the kernel sets ctime on every such write and no user can
    set it back, and a file renamed over the path has another inode. A chmod or a new hard link changes ctime too:
    that only costs one more read of the file.
    """
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
