"""Text that members control written so that it shows as itself, on one line: every control, format, line-separator
and surrogate character as a visible escape (`\\x1b`, `\\u202e`, `\\u2028`, `\\ud800`).

Event fields, refusal messages (which name a sender's own keys) and undecodable messages' errors come from members.
Shown as they are, an escape sequence in them clears a terminal, sets its title or plants a link, a carriage return,
a newline or a line separator forges a log line, a table row or a second line of a one-line refusal, a bidi control
disguises text, and a lone surrogate (a JSON escape) cannot be encoded for any terminal, file or database.
"""

from __future__ import annotations

import unicodedata

# Unicode categories written as escapes: controls (C0, DEL, C1), format characters (bidi controls, zero widths),
# line and paragraph separators, and surrogates (only a lone one reaches a str).
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


def display_text(value: object) -> str:
    """`str(value)` with every control, format, line-separator and surrogate character written as a visible escape."""
    text = str(value)
    if text.isprintable():  # the common case: nothing to escape (isprintable is False for all those categories)
        return text
    return "".join(_escaped(character) for character in text)


def _escaped(character: str) -> str:
    if unicodedata.category(character) not in _ESCAPED_CATEGORIES:
        return character
    code = ord(character)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
