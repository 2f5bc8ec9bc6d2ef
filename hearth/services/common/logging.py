"""One logging setup for every hearth command: level from the caller, timestamps, logger names, stderr."""

from __future__ import annotations

import logging
import sys

from hearth.services.common.display import DisplaySafeFormatter

LOG_LEVEL_ENV = "HEARTH_LOG_LEVEL"
default_log_level = "INFO"
# How much of a failed child process's log an error shows.
log_tail_chars = 3000
LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
# Chatty third-party loggers that would drown hearth's own lines at DEBUG.
QUIETER_LOGGERS = ("asyncio", "nats", "alembic.runtime.migration", "alembic.runtime.plugins", "urllib3", "filelock")


def parse_log_level(level: str | int) -> int:
    """`"info"`, `"DEBUG"`, `20` → a logging level number; ValueError for anything else."""
    if isinstance(level, int):
        return level
    text = level.strip().upper()
    if text.isdigit():
        return int(text)
    number = logging.getLevelName(text)
    if not isinstance(number, int):
        raise ValueError(f"unknown log level {level!r} (use DEBUG, INFO, WARNING, ERROR or CRITICAL)")
    return number


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at emit time (test runners and CLIs swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def configure_logging(level: str | int = "INFO") -> None:
    """Send log records at `level` and above to stderr in one format; safe to call more than once."""
    number = parse_log_level(level)
    handler = _CurrentStderrHandler()
    handler.setFormatter(DisplaySafeFormatter(LOG_FORMAT))  # members' text in a record forges no line
    logging.basicConfig(level=number, handlers=[handler], force=True)
    for name in QUIETER_LOGGERS:
        logging.getLogger(name).setLevel(max(number, logging.WARNING))
