"""Read-only SQLite connections to a file named by its path, whatever characters the path holds."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from urllib.parse import quote

# How long a read waits for the projector's write lock before giving up ("database is locked").
busy_wait_s = 5.0


def read_only_uri(path: str | Path) -> str:
    """`file:PATH?mode=ro` with PATH percent-encoded: a `?` or `#` in it would otherwise end the path there, and
    SQLite would open (creating it, read-write) the file named by what came before."""
    return f"file:{quote(str(path))}?mode=ro"


def open_read_only(path: str | Path, *, busy_wait: float = busy_wait_s) -> sqlite3.Connection:
    """A read-only connection to the SQLite file at `path` (waiting up to `busy_wait` seconds for a writer), as
    Grafana's datasource opens a read model."""
    return sqlite3.connect(read_only_uri(path), uri=True, timeout=busy_wait)
