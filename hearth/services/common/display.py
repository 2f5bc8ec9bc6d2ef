"""Text that members control, made safe to show in a rich table and in a log line: `display_text`
(hearth/protocol/display_text.py) writes every control and format character as a visible escape, `display_cell` also
keeps rich from reading markup in it, and `DisplaySafeFormatter` keeps a log record to one line.
"""

from __future__ import annotations

import logging

from rich.text import Text

from hearth.protocol.display_text import display_text


def display_cell(value: object) -> Text:
    """A rich table cell showing `value` as plain text (no markup read in it), escaped as `display_text`."""
    return Text(display_text(value))


class DisplaySafeFormatter(logging.Formatter):
    """A log formatter whose lines carry no control character a logged value brought: one record, one line."""

    def format(self, record: logging.LogRecord) -> str:
        return display_text(super().format(record)).replace("\\x0a", "\n  ")
