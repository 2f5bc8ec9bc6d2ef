"""A projector's warning for an event signed by a key its roster copy does not name says what usually causes it: a
member added, or a key rotated, since this machine got its roster (hearth/readmodels/rejections.py). Walking the
docs, a rotated shard host's events were rejected `unknown_signer` at every other household, and the log line gave
the operator nothing to go on."""

from __future__ import annotations

import logging

from hearth.events.consume import StoredEvent
from hearth.readmodels.rejections import record_rejection
from tests.readmodel_helpers import at, heartbeat


class Rows:
    """The two calls record_rejection makes on a batch's rows."""

    def __init__(self) -> None:
        self.kept: list[dict] = []

    def edit(self, _table, _key, make):
        return make()

    def put(self, _table, _key, row):
        self.kept.append(row)


def rejected(reason, caplog) -> str:
    event = heartbeat("tiny:0-1@attic").model_copy(update={"signer": "UABC"})
    stored = StoredEvent(stream="HEARTH_SHARDS", seq=7, subject="s", time=at(1), headers={}, event=event)
    with caplog.at_level(logging.WARNING, logger="hearth.readmodels.rejections"):
        record_rejection(stored, reason, Rows(), projection="readmodels", samples_per_minute=None)
    [line] = [record.getMessage() for record in caplog.records]
    return line


def test_an_unknown_signer_names_the_roster_copy_as_the_likely_cause(caplog):
    line = rejected("unknown_signer", caplog)
    assert line.startswith("readmodels: rejected HEARTH_SHARDS #7 shard.heartbeat")
    assert "roster" in line and "added" in line and "rotated" in line


def test_other_reasons_keep_their_line(caplog):
    assert rejected("future_dated", caplog).endswith(": future_dated")
