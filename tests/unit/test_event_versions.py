"""Events of another hearth version (hearth/events/models.py, decode_event): an older version of a type is brought
forward by its upcasters, while a newer version (a breaking change this hearth cannot read) or a type this hearth does
not know is refused in one line naming it, never read as if it were this hearth's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hearth.events.consume import SkippedMessage, decode_stored_message
from hearth.events.models import ShardAdvertised, decode_event
from tests.readmodel_helpers import T0

RECORDED = Path(__file__).resolve().parents[1] / "data" / "before_protocol_versions" / "shard_advertised.json"


def recorded_advert(**changes) -> bytes:
    return json.dumps({**json.loads(RECORDED.read_text()), **changes}).encode()


def test_an_event_of_an_older_hearth_reads():
    event = decode_event(recorded_advert())
    assert isinstance(event, ShardAdvertised) and event.protocol is None


def test_a_newer_version_of_a_known_type_is_refused_naming_both_versions():
    with pytest.raises(ValueError) as refused:
        decode_event(recorded_advert(version=2))
    assert str(refused.value) == ("shard.advertised version 2 is newer than this hearth reads (up to 1): "
                                  "upgrade it to read this event")


def test_a_type_this_hearth_does_not_know_is_refused_naming_it_and_skipped():
    skipped = decode_stored_message("HEARTH_SHARDS", 7, "hearth.events.shard.attic.x.moved", T0, None,
                                    recorded_advert(type="shard.moved"))
    assert isinstance(skipped, SkippedMessage)
    assert skipped.error == ("ValueError: event type 'shard.moved' is not one this hearth knows (a newer hearth's?): "
                             "upgrade it to read this event")
