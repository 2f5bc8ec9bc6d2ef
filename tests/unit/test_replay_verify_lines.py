"""hearth-replay verify's line about a bad event stays one line whatever the event's member-written fields hold."""

from __future__ import annotations

from hearth.services.replay.verify import UNDECODABLE, BadEvent

FORGED_LINE = "\nHEARTH_PIPELINES#7 pipeline.completed abc node=orch signer=none: looks fine\x1b[2J\u202e"


def test_a_bad_events_line_shows_its_fields_escaped_on_one_line():
    bad = BadEvent("HEARTH_SHARDS", 3, "unsigned", event_type="shard.withdrawn", event_id="e" + FORGED_LINE,
                   node_id="n" + FORGED_LINE)

    line = bad.line()

    assert line.isprintable() and line.startswith("HEARTH_SHARDS#3 shard.withdrawn e\\x0a")
    assert line.endswith(": unsigned")


def test_an_undecodable_messages_line_is_one_line_too():
    line = BadEvent("HEARTH_SHARDS", 4, UNDECODABLE, detail="bad" + FORGED_LINE).line()

    assert line.isprintable() and line.startswith(f"HEARTH_SHARDS#4 {UNDECODABLE}: bad\\x0a")
