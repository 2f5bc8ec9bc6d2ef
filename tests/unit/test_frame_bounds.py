"""Frames from a hostile or buggy orchestrator (a roster member): every field past its bounds is read as the nearest
value within them, so the frame still counts and no client passes the value on (docs/protocol.md, "Reading a
frame"): log-probabilities that are no number (a 500 from the gateway's JSON before), negative or huge usage (passed
to OpenAI clients as it was), timings that are no number (`hearth chat` printed "nan"), texts and lists of any size;
while what says which frame or choice it is stays refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from hearth.protocol.bounds import (
    lowest_logprob, max_frame_number, max_label_chars, max_pipeline_hops, max_reason_chars, max_shard_id_chars,
)
from hearth.protocol.chat import max_top_logprobs
from hearth.protocol.chat_frames import decode_frame, max_timing_extras
from hearth.services.client.command import ChatPrinter
from tests.unit.test_withdrawn_tokens import MODEL, chat_body, events_of, gateway  # noqa: F401 (a fixture)

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def frame(**fields):
    """The frame a client decodes from `fields` sent as JSON (NaN and infinities as JSON's extensions write them)."""
    return decode_frame(json.dumps(fields, allow_nan=True).encode())


def done(**fields):
    return frame(**{"type": "done", "seq": 1, "finish_reason": "stop",
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1}, **fields})


def token_with_logprob(logprob: float, alternative: float):
    return frame(type="token_delta", seq=0, text="a", token_id=7, logprobs={
        "text": "a", "logprob": logprob, "top_logprobs": [{"token_id": 7, "text": "a", "logprob": alternative}]})


@pytest.mark.parametrize("logprob, alternative, read", [
    (float("nan"), float("-inf"), (lowest_logprob, lowest_logprob)),
    (float("inf"), 1e308, (0.0, 0.0)),
    (-1e308, -0.5, (lowest_logprob, -0.5)),
])
async def test_a_logprob_that_is_no_probability_reads_as_the_nearest_one(gateway, logprob, alternative, read):
    http, scripted = gateway
    scripted.scripts.append([token_with_logprob(logprob, alternative), done()])
    chat = await http.post("/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=1))
    assert chat.status_code == 200, chat.text  # NaN and infinities were a 500: JSON has none of them
    content = chat.json()["choices"][0]["logprobs"]["content"][0]
    assert (content["logprob"], content["top_logprobs"][0]["logprob"]) == read
    scripted.scripts.append([token_with_logprob(logprob, alternative), done()])
    completion = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "logprobs": 1})
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["logprobs"]["token_logprobs"] == [read[0]]
    scripted.scripts.append([token_with_logprob(logprob, alternative), done()])
    streamed = await http.post("/v1/chat/completions", json=chat_body(logprobs=True, stream=True))
    chunk = json.loads(events_of(streamed)[1])  # the token's chunk: a number, never null
    assert chunk["choices"][0]["logprobs"]["content"][0]["logprob"] == read[0]


@pytest.mark.parametrize("usage, read", [
    ({"prompt_tokens": -5, "completion_tokens": 10**40}, (0, max_frame_number)),
    ({"prompt_tokens": 1e308, "completion_tokens": -1e308}, (max_frame_number, 0)),
])
async def test_usage_out_of_bounds_reads_as_the_nearest_count(gateway, usage, read):
    http, scripted = gateway
    scripted.scripts.append([frame(type="token_delta", seq=0, text="a", token_id=7), done(usage=usage)])
    answer = (await http.post("/v1/chat/completions", json=chat_body())).json()
    assert (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]) == read
    assert answer["usage"]["total_tokens"] == sum(read)


async def test_a_withdrawal_keeping_more_tokens_than_were_sent_takes_nothing_back(gateway):
    http, scripted = gateway
    scripted.scripts.append([
        frame(type="token_delta", seq=0, text="Hi", token_id=7),
        frame(type="tokens_withdrawn", seq=1, kept_tokens=10**40, shard_id="m:0-1@x", reason="r"),
        frame(type="token_delta", seq=2, text="!", token_id=8), done(seq=3)])
    events = events_of(await http.post("/v1/chat/completions", json=chat_body(stream=True)))
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(event)["choices"][0]["delta"].get("content") or ""
                   for event in events[:-1] if json.loads(event)["choices"]) == "Hi!"


def test_hearth_chat_prints_no_timing_that_is_no_number_and_no_reason_of_any_length(capsys):
    ending = done(finish_reason="x" * 100_000, timing={"ttft_ms": float("nan"), "tokens_per_second": -1e308,
                                                       "duration_ms": float("inf"), "construct_ms": "x" * 100_000})
    ChatPrinter().show(ending)
    line = capsys.readouterr().err
    assert "nan" not in line and "inf" not in line and len(line) < 200, line
    assert line.startswith("[" + "x" * max_label_chars + ": 1 tokens, 0.0 tokens/s, ttft 0 ms]")


def test_texts_and_lists_past_their_bounds_are_cut_and_the_frame_counts():
    hops = [f"m:0-1@{'h' * 1000}{index}" for index in range(1000)]
    pipeline = frame(type="pipeline", seq=0, pipeline_id="p" * 1000, hops=hops)
    assert len(pipeline.hops) == max_pipeline_hops and {len(hop) for hop in pipeline.hops} == {max_shard_id_chars}
    assert len(frame(type="token_delta", seq=1, text="a", token_id=1, hops=hops).hops) == max_pipeline_hops
    failover = frame(type="shard_failover", seq=2, failed_shard_id="s" * 10**6, replacement_hops=hops,
                     resumed_at_token=-3)
    assert (len(failover.failed_shard_id), len(failover.replacement_hops), failover.resumed_at_token) == (
        max_shard_id_chars, max_pipeline_hops, 0)
    status = frame(type="shard_status", seq=3, shard_id="s", status="degraded", reason="r" * 10**6)
    assert len(status.reason) == max_reason_chars
    aborted = frame(type="pipeline_aborted", seq=4, code="internal_error", reason="é" * 10**6)
    assert aborted.reason == "é" * max_reason_chars
    error = frame(type="error", seq=0, code="bad_request", message="m" * 10**6, param="p" * 10**4)
    assert (len(error.message), error.param) == (max_reason_chars, None)
    alternatives = [{"token_id": index, "text": "a", "logprob": -1.0} for index in range(500)]
    token = frame(type="token_delta", seq=5, text="a", token_id=1,
                  logprobs={"text": "a", "logprob": -1.0, "top_logprobs": alternatives})
    assert len(token.logprobs.top_logprobs) == max_top_logprobs
    queued = frame(type="queued", seq=0, position=0, queued_requests=10**40)
    assert (queued.position, queued.queued_requests) == (1, max_frame_number)
    ending = done(orchestrator="o" * 10**4, choices=[{"choice": 0, "finish_reason": "f" * 10**4,
                                                       "completion_tokens": -1}],
                  timing={f"extra_{index}": index for index in range(100)} | {"note": "x" * 10**6, "failovers": 2})
    assert ending.orchestrator is None  # no pin to a name no orchestrator can have
    assert (len(ending.choices[0].finish_reason), ending.choices[0].completion_tokens) == (max_label_chars, 0)
    assert "note" not in ending.timing.model_extra and len(ending.timing.model_extra) == max_timing_extras


@pytest.mark.parametrize("fields", [
    {"type": "token_delta", "seq": -1, "text": "a", "token_id": 1},
    {"type": "token_delta", "seq": 0, "text": "a", "token_id": 1, "choice": 8},
    {"type": "pipeline_aborted", "seq": 0, "code": "no_such_code", "reason": "r"},
    {"type": "shard_status", "seq": 0, "shard_id": "s", "status": "dead", "reason": "r"},
    {"type": "done", "seq": 0, "finish_reason": "stop", "usage": {"prompt_tokens": float("nan"),
                                                                   "completion_tokens": 1}},
])
def test_what_says_which_frame_choice_or_error_it_is_stays_refused(fields):
    with pytest.raises(ValidationError):
        frame(**fields)


@pytest.mark.parametrize("example", ["chat_frames.jsonl", "chat_errors.jsonl"])
def test_a_correct_orchestrator_s_frames_read_as_sent(example):
    for line in (EXAMPLES / example).read_text().splitlines():
        sent = json.loads(line)
        assert decode_frame(line.encode()).model_dump(mode="json", exclude_none=True) == sent
