"""`hearth doctor`'s broker checks judged on what a stand-in connection answers: this clock against the broker's
(ok, warned of, failed beyond [events] max_clock_skew_s; a caller's against the orchestrator that answers it, skipped
where none says its time), the event streams a role waits for,
whether an orchestrator answers, and the skip lines each role gets when there is no login."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import NotFoundError

from hearth.protocol.discovery import ModelsReply, ServedModel
from hearth.services.doctor.broker_checks import (
    ask_orchestrators,
    clock_check,
    shown_url,
    skipped_broker_checks,
    streams_check,
)

MAX_SKEW_S = 30.0


class StandInConnection:
    """Answers a request with `answer` (bytes, or an exception to raise); a stream-info lookup finds `streams`."""

    def __init__(self, answer=b"", streams=()) -> None:
        self.answer, self.streams, self.asked = answer, set(streams), []

    async def request(self, subject, payload, timeout):
        self.asked.append(subject)
        if isinstance(self.answer, Exception):
            raise self.answer
        return SimpleNamespace(data=self.answer)

    def jetstream(self):
        streams = self.streams

        class StandInJetStream:
            async def stream_info(self, name):
                if name not in streams:
                    raise NotFoundError(code=404, description="stream not found")
                return SimpleNamespace()

        return StandInJetStream()


def broker_time_answer(offset_s: float) -> bytes:
    """A stream-info answer dated `offset_s` after this clock's now."""
    stamp = datetime.fromtimestamp(time.time() + offset_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return json.dumps({"ts": stamp}).encode()


@pytest.mark.parametrize("broker_ahead_s,verdict", [(0.0, "ok"), (20.0, "warn"), (-20.0, "warn"), (300.0, "fail"),
                                                     (-300.0, "fail")])
async def test_this_clock_is_judged_against_the_brokers(broker_ahead_s, verdict):
    connection = StandInConnection(broker_time_answer(broker_ahead_s))
    check = await clock_check(connection, "HEARTH_SHARDS", MAX_SKEW_S)
    assert check.verdict == verdict, check
    assert connection.asked == ["$JS.API.STREAM.INFO.HEARTH_SHARDS"]
    if verdict == "fail":
        said = "behind" if broker_ahead_s > 0 else "ahead of"
        assert f"about 300 s {said} the broker's clock" in check.detail and "NTP" in check.fix


async def test_a_broker_that_does_not_say_its_time_or_answer_is_a_warning():
    assert (await clock_check(StandInConnection(b'{"error": {}}'), "S", MAX_SKEW_S)).verdict == "warn"
    assert (await clock_check(StandInConnection(NatsTimeoutError()), "S", MAX_SKEW_S)).verdict == "warn"


async def test_a_caller_that_may_read_no_stream_is_skipped_saying_whose_clock_judges_it():
    check = await clock_check(StandInConnection(), None, MAX_SKEW_S)
    assert check.verdict == "skip" and "orchestrator's clock" in check.detail


def models_answer(orchestrator_ahead_s: float | None) -> bytes:
    """An orchestrator's `llm.models` answer, its clock `orchestrator_ahead_s` after this one (None: unsaid)."""
    stamp = None if orchestrator_ahead_s is None else time.time() + orchestrator_ahead_s
    reply = ModelsReply(models=[ServedModel(id="tiny", total_layers=6, complete=True)], default_model="tiny",
                        orchestrator_time_s=stamp)
    return reply.model_dump_json().encode()


@pytest.mark.parametrize("orchestrator_ahead_s,verdict", [(0.0, "ok"), (20.0, "warn"), (-300.0, "fail"),
                                                           (None, "skip")])
async def test_a_callers_clock_is_judged_against_the_orchestrator_that_answers_it(orchestrator_ahead_s, verdict):
    connection = StandInConnection(models_answer(orchestrator_ahead_s))
    answer = await ask_orchestrators(connection)
    assert answer.check.verdict == "ok" and connection.asked == ["llm.models"]
    check = await clock_check(connection, None, MAX_SKEW_S, orchestrator_offset_s=answer.offset_s)
    assert check.verdict == verdict, check
    if verdict == "fail":
        assert "about 300 s ahead of an orchestrator's clock" in check.detail and "calls are refused" in check.detail
    if verdict == "ok":
        assert "of an orchestrator's" in check.detail
    assert connection.asked == ["llm.models"]  # the broker is asked nothing more


async def test_the_streams_a_role_waits_for_must_exist():
    connection = StandInConnection(streams={"HEARTH_SHARDS"})
    assert (await streams_check(connection, ("HEARTH_SHARDS",), "nats://hub:4222")).verdict == "ok"
    missing = await streams_check(connection, ("HEARTH_SHARDS", "HEARTH_PIPELINES"), "nats://hub:4222")
    assert missing.verdict == "fail"
    assert "HEARTH_PIPELINES do not exist on nats://hub:4222" in missing.detail
    assert "hearth nats --community" in missing.detail


async def test_whether_an_orchestrator_answers():
    nobody = await ask_orchestrators(StandInConnection(NoRespondersError()))
    assert nobody.check.verdict == "warn" and "hearth orchestrator" in nobody.check.fix and nobody.offset_s is None
    served = await ask_orchestrators(StandInConnection(models_answer(None)))
    assert served.check.verdict == "ok" and "tiny" in served.check.detail


def test_each_role_says_which_broker_checks_it_skipped():
    assert [check.check for check in skipped_broker_checks("projector", "why")] == ["streams", "clock"]
    assert [check.check for check in skipped_broker_checks("client", "why")] == ["clock", "orchestrators"]
    assert [check.check for check in skipped_broker_checks("host", "why", "store:m")] == ["streams", "clock", "model"]
    assert all(check.verdict == "skip" for check in skipped_broker_checks("gateway", "why"))


def test_a_password_in_the_broker_url_is_never_shown():
    assert shown_url("nats://u:secret@a:4222,nats://u:secret@b:4222") == "nats://***@a:4222,nats://***@b:4222"
