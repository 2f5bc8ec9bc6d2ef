"""A member whose clock is off beyond [events] max_clock_skew_s: the refusal tells the sender which way and by whose
clock, and the receiver logs it once a while per member (not per call), counting every such message."""

from __future__ import annotations

import logging

from hearth.events.clock_skew import ClockSkewReports
from hearth.events.metrics import skewed_clock_messages_total
from hearth.services.common.call_signing import HEADER_CALLER_SIGNATURE, CallRefused, signed_call_headers
from tests.unit.test_call_signing import BODY, NOW_S, REPLY, SUBJECT, community

SKEW_LOGGER = "hearth.events.clock_skew"


def skewed_count(what: str) -> float:
    return skewed_clock_messages_total.labels(what)._value.get()  # noqa: SLF001 - prometheus_client's own value


def test_a_call_from_a_clock_ahead_or_behind_is_refused_saying_which_way_and_by_whom():
    verifier, alice, _, _ = community()
    ahead = signed_call_headers(alice, SUBJECT, REPLY, BODY, now_s=NOW_S + 300)
    refused = verifier.check(SUBJECT, REPLY, BODY, ahead, now_s=NOW_S)
    assert isinstance(refused, CallRefused) and refused.reason == "stale"
    assert "dated about 300 s ahead of this orchestrator's clock (at most 30 s allowed)" in refused.message
    behind = signed_call_headers(alice, SUBJECT, REPLY, BODY, now_s=NOW_S - 3600)
    assert "about 3600 s behind this orchestrator's clock" in verifier.check(SUBJECT, REPLY, BODY, behind,
                                                                              now_s=NOW_S).message
    # Just inside the limit, either way: accepted.
    for offset_s in (29.9, -29.9):
        inside = signed_call_headers(alice, SUBJECT, REPLY, BODY, now_s=NOW_S + offset_s)
        assert not isinstance(verifier.check(SUBJECT, REPLY, BODY, inside, now_s=NOW_S), CallRefused)


def test_the_receiver_logs_a_members_skewed_clock_once_and_counts_every_call(caplog):
    verifier, alice, bob, _ = community()
    counted_before = skewed_count("call")
    with caplog.at_level(logging.WARNING, logger=SKEW_LOGGER):
        for n in range(50):
            headers = signed_call_headers(alice, SUBJECT, REPLY, BODY, now_s=NOW_S + n + 300)
            assert verifier.check(SUBJECT, REPLY, BODY, headers, now_s=NOW_S + n).reason == "stale"
        bobs = signed_call_headers(bob, SUBJECT, REPLY, BODY, now_s=NOW_S - 120)
        verifier.check(SUBJECT, REPLY, BODY, bobs, now_s=NOW_S)
    lines = [record.getMessage() for record in caplog.records if record.name == SKEW_LOGGER]
    assert len(lines) == 2, lines
    assert lines[0].startswith("alice's clock is about 300 s ahead of this orchestrator's clock")
    assert lines[1].startswith("bob's clock is about 120 s behind this orchestrator's clock")
    assert skewed_count("call") - counted_before == 51


def test_a_forged_stale_call_in_a_members_name_is_refused_but_not_blamed_on_the_member(caplog):
    verifier, alice, _, _ = community()
    forged = {**signed_call_headers(alice, SUBJECT, REPLY, BODY, now_s=NOW_S + 300),
              HEADER_CALLER_SIGNATURE: "A" * 86 + "=="}
    with caplog.at_level(logging.WARNING, logger=SKEW_LOGGER):
        assert verifier.check(SUBJECT, REPLY, BODY, forged, now_s=NOW_S).reason == "stale"
    assert not [record for record in caplog.records if record.name == SKEW_LOGGER]


def test_a_member_is_told_again_only_after_the_report_interval(caplog):
    now = [0.0]
    reports = ClockSkewReports(every_s=900, monotonic=lambda: now[0])
    told = []
    for now[0] in (0.0, 10.0, 899.0, 900.0, 901.0):
        told.append(reports.skewed("event", "host-a", 300.0, clock="the broker's clock", allowed_s=30,
                                   consequence="its events are rejected"))
    assert told == [True, False, False, True, False]
