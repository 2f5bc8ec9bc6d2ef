"""Text members wrote is shown escaped: on a terminal (hearth-replay, hearth status, hearth chat), in a rich table and
in a log line, no escape sequence, carriage return, newline, line separator, bidi control or rich markup of theirs
takes effect (hearth/protocol/display_text.py, hearth/services/common/display.py). Before, an advert's model id set the
terminal's title and planted a link in `hearth status`, and a withdrawal's reason erased a hearth-replay row and
printed a forged one."""

from __future__ import annotations

import io
import logging

from rich.console import Console
from rich.table import Table

from hearth.events.consume import SkippedMessage
from hearth.events.models import PipelineAborted, ShardWithdrawn
from hearth.protocol.display_text import display_text
from hearth.services.common.display import DisplaySafeFormatter
from hearth.services.common.logging import LOG_FORMAT
from hearth.services.dashboards.status import _add_row
from hearth.services.replay.render import table_row
from hearth.services.replay.reports import pipeline_timeline
from hearth.services.replay.shard_view import shard_view_lines
from tests.readmodel_helpers import T0, LogBuilder, advertised

HOSTILE = "ok\r\x1b[2K\x1b]0;PWNED\x07\x1b]8;;https://evil.example/\x1b\\\u202egpj.exe\nforged line"


def test_controls_and_format_characters_become_visible_escapes_and_other_text_stays():
    shown = display_text(HOSTILE)
    assert not any(ch in shown for ch in "\r\n\x1b\x07\u202e")
    assert shown.startswith("ok\\x0d\\x1b[2K\\x1b]0;PWNED\\x07") and "\\u202egpj.exe\\x0aforged line" in shown
    assert display_text("Zürich 中文 🙂 m:0-3@n") == "Zürich 中文 🙂 m:0-3@n"


def test_a_log_record_carrying_a_members_text_stays_one_line_per_record():
    record = logging.LogRecord("hearth.projector", logging.WARNING, __file__, 1, "rejected from node %s", (HOSTILE,),
                               None)
    line = DisplaySafeFormatter(LOG_FORMAT).format(record)
    assert "\r" not in line and "\x1b" not in line
    assert all(part.startswith("  ") for part in line.split("\n")[1:])  # a continuation, never a line of its own


def test_a_status_cell_shows_markup_and_escapes_as_text():
    table = Table("model")
    _add_row(table, "[link=https://evil.example/]tiny[/link][bold red]x\x1b]0;t\x07")
    out = io.StringIO()
    Console(file=out, force_terminal=True, width=120).print(table)
    raw = out.getvalue()
    assert "\x1b]8;" not in raw and "\x1b]0;" not in raw  # no link, no title
    assert "[link=https://evil.example/]tiny[/link][bold red]x\\x1b]0;t\\x07" in raw


def test_a_replay_row_of_a_members_event_or_of_an_undecodable_message_is_one_line():
    withdrawn = LogBuilder().stored(ShardWithdrawn(shard_id="m:0-3@n", reason=HOSTILE, node_id="n"))
    skipped = SkippedMessage("HEARTH_SHARDS", 7, "hearth.events.shard.n.x", T0, f"Input tag {HOSTILE!s}")
    for row in (table_row(withdrawn), table_row(skipped)):
        assert not any(ch in row for ch in "\r\n\x1b\x07\u202e"), row


def test_the_pipeline_timeline_and_the_shard_view_show_a_members_text_escaped():
    log = LogBuilder()
    advert = log.stored(advertised(0, 3, "n", model_id="m\x1b]0;t\x07"))
    withdrawn = log.stored(ShardWithdrawn(shard_id=advert.event.shard_id, reason=HOSTILE, node_id="n"))
    lines = shard_view_lines("n", advert.event.shard_id, [advert, withdrawn], [], 30.0, now=T0)
    aborted = log.stored(PipelineAborted(pipeline_id="p1", code="x", reason=HOSTILE, node_id="hub"))
    for line in lines + pipeline_timeline("p1", [aborted]):
        assert not any(ch in line for ch in "\r\n\x1b\x07\u202e"), line


def test_line_separators_and_a_lone_surrogate_are_escaped_too():
    """Python's splitlines breaks at U+2028 and U+2029, and a lone surrogate (a JSON escape) encodes for no terminal,
    file or database."""
    shown = display_text("a\u2028b\u2029c\ud800d")
    assert shown == "a\\u2028b\\u2029c\\ud800d"
    assert len(shown.splitlines()) == 1 and shown.encode("utf-8")
