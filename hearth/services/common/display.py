"""Text that members control, made safe to show: on an operator's terminal, in a rich table or in a log line.

Event fields (a reason, a model id, a shard id's model part), refusal messages and undecodable messages' errors come
from members. Shown as they are, an escape sequence in them clears a terminal, sets its title or plants a link, a
carriage return or a newline forges a log line or a table row, a bidi control disguises text, and rich markup in a
table cell styles or links it. `display_text` writes every control and format character as a visible escape
(`\\x1b`, `\\u202e`), and `display_cell` also keeps rich from reading markup in it.
"""

from __future__ import annotations

import logging
import unicodedata

from rich.text import Text

# Unicode categories written as escapes: controls (C0, DEL, C1) and format characters (bidi controls, zero widths).
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf"})


def display_text(value: object) -> str:
    """`str(value)` with every control and format character written as a visible escape."""
    text = str(value)
    if text.isprintable():  # the common case: nothing to escape (isprintable is False for Cc and Cf)
        return text
    return "".join(_escaped(character) for character in text)


def _escaped(character: str) -> str:
    if unicodedata.category(character) not in _ESCAPED_CATEGORIES:
        return character
    code = ord(character)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def display_cell(value: object) -> Text:
    """A rich table cell showing `value` as plain text (no markup read in it), escaped as `display_text`."""
    return Text(display_text(value))


class DisplaySafeFormatter(logging.Formatter):
    """A log formatter whose lines carry no control character a logged value brought: one record, one line."""

    def format(self, record: logging.LogRecord) -> str:
        return display_text(super().format(record)).replace("\\x0a", "\n  ")
