"""`hearth chat` ends an answer past its request's bound (hearth/services/client/answer_bound.py) that a hostile
orchestrator streams: one error line, a WARNING naming the call, exit code 1, and none of the text past the bound;
ChatResult (`chat()`), `hearth bench` and `hearth demo` end it too, with an internal_error frame of their own."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from hearth.services.broker.connection import flush_ordered
from hearth.protocol.chat import ChatRequest
from hearth.protocol.chat_frames import max_withdrawals_per_choice
from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT
from hearth.services.client.chat import chat
from hearth.services.common.config import NatsSettings
from hearth.services.devtools.bench.errors import BenchError
from hearth.services.devtools.bench.pipeline import pipeline_generation
from hearth.services.devtools.demo import DemoRun
from hearth.services.devtools.demo_model import DemoModel

pytestmark = pytest.mark.integration
HEARTH = str(Path(sys.executable).parent / "hearth")


async def hearth_chat_against(nats_url: str, frames_of, max_tokens: int) -> subprocess.CompletedProcess:
    """Run `hearth chat --max-tokens max_tokens hello` against a hostile orchestrator that answers a request with
    `frames_of(request)` (frame dicts, published in order); the requests it got are appended to `.requests`."""
    hostile = await nats.connect(nats_url)
    requests: list[dict] = []

    async def answer(msg) -> None:
        requests.append(json.loads(msg.data))
        for frame in frames_of(requests[-1]):
            await hostile.publish(msg.reply, json.dumps(frame).encode())

    try:
        await hostile.subscribe(CHAT_REQUEST_SUBJECT, queue="hearth-orchestrators", cb=answer)
        await flush_ordered(hostile)
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("HEARTH_")}, "HEARTH_NATS__INSECURE": "1"}
        completed = await asyncio.to_thread(
            subprocess.run, [HEARTH, "chat", "--nats", nats_url, "--max-tokens", str(max_tokens), "hello"],
            capture_output=True, text=True, env=env, timeout=60)
    finally:
        await hostile.close()
    completed.requests = requests
    return completed


async def test_hearth_chat_ends_a_hostile_orchestrator_s_answer_at_max_tokens(nats_url):
    completed = await hearth_chat_against(nats_url, lambda request: (
        # far more tokens than the call's max_tokens 2
        {"type": "token_delta", "seq": seq, "text": "ok" if seq < 2 else "LEAK", "token_id": 1} for seq in range(1000)),
        max_tokens=2)
    assert completed.returncode == 1, completed.stderr
    assert completed.stdout == "okok\n"
    errors = [line for line in completed.stderr.splitlines() if line.startswith("error ")]
    assert errors == ["error answer_too_long: the orchestrator sent choice 0 more token frames than the request's "
                      "max_tokens 2: no correct orchestrator does, so the call was ended"], completed.stderr
    warnings = [line for line in completed.stderr.splitlines() if "WARNING hearth.services.client" in line]
    assert len(warnings) == 1 and completed.requests[0]["request_id"] in warnings[0], completed.stderr


# --- the other readers: ChatResult (chat()), `hearth bench`, `hearth demo` --------------------------------------


async def _answering_without_end(nc) -> list[dict]:
    """A hostile orchestrator on the queue group: far more tokens than any call's max_tokens 2; the requests it got."""
    requests: list[dict] = []

    async def answer(msg) -> None:
        requests.append(json.loads(msg.data))
        for seq in range(1000):
            frame = {"type": "token_delta", "seq": seq, "text": "ok" if seq < 2 else "LEAK", "token_id": 1}
            await nc.publish(msg.reply, json.dumps(frame).encode())

    await nc.subscribe(CHAT_REQUEST_SUBJECT, queue="hearth-orchestrators", cb=answer)
    await flush_ordered(nc)
    return requests


async def test_chat_result_ends_a_hostile_orchestrator_s_answer_at_max_tokens(nats_url):
    hostile, client = await nats.connect(nats_url), await nats.connect(nats_url)
    try:
        await _answering_without_end(hostile)
        result = await chat(client, ChatRequest(prompt="hello", max_tokens=2))
    finally:
        await client.close()
        await hostile.close()
    assert result.text == "okok" and not result.ok, result.error
    assert (result.error.code, result.error.seq) == ("internal_error", 2)
    assert result.error.message.startswith("the orchestrator sent choice 0 more token frames than the request's "
                                           "max_tokens 2")


async def test_hearth_bench_refuses_a_hostile_orchestrator_s_answer_past_max_tokens(nats_url):
    hostile, client = await nats.connect(nats_url), await nats.connect(nats_url)
    try:
        await _answering_without_end(hostile)
        timing = await pipeline_generation(client, "scripted", "hello", 2, refusal_is_error=False)
        with pytest.raises(BenchError, match="more token frames than the request's max_tokens 2"):
            await pipeline_generation(client, "scripted", "hello", 2)
    finally:
        await client.close()
        await hostile.close()
    assert (timing.error_code, timing.tokens) == ("internal_error", 2)


class _DemoStandIn:
    """What DemoRun._ask reads of its run and its cluster: a raw prompt of max_tokens 2 over `nats_url`'s broker."""

    raw, prompt, max_tokens = True, "hello", 2
    _request, _ask = DemoRun._request, DemoRun._ask

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url

    def member_key(self, *_args) -> None:
        return None

    def nats_settings(self, _creds) -> NatsSettings:
        return NatsSettings(url=self.nats_url, insecure=True)


async def test_hearth_demo_ends_a_hostile_orchestrator_s_answer_at_max_tokens(nats_url, capsys):
    hostile = await nats.connect(nats_url)
    demo = _DemoStandIn(nats_url)
    try:
        await _answering_without_end(hostile)
        model = DemoModel(path=Path("scripted"), num_layers=1, has_chat_template=False)
        assert await demo._ask(demo, model) is False
    finally:
        await hostile.close()
    out = capsys.readouterr().out
    assert "LEAK" not in out and "okok\nerror internal_error: the orchestrator sent choice 0 more token frames" in out


async def test_hearth_chat_ends_a_call_withdrawn_without_end_printing_the_answer_a_bounded_number_of_times(nats_url):
    """An orchestrator that sends the whole allowance, takes it back and sends it again forever: `hearth chat` prints
    the kept text again after each withdrawal, so past the protocol's bound it ends the call."""
    def withdrawn_again_and_again(request: dict):
        yield {"type": "token_delta", "seq": 0, "text": "ok", "token_id": 1}
        for round_ in range(1000):
            yield {"type": "tokens_withdrawn", "seq": 2 * round_ + 1, "kept_tokens": 0, "shard_id": "m:0-1@x",
                   "reason": "refuted"}
            yield {"type": "token_delta", "seq": 2 * round_ + 2, "text": "ok", "token_id": 1}

    completed = await hearth_chat_against(nats_url, withdrawn_again_and_again, max_tokens=1)
    assert completed.returncode == 1, completed.stderr
    assert completed.stdout == "ok\n" * (max_withdrawals_per_choice + 1)
    errors = [line for line in completed.stderr.splitlines() if line.startswith("error ")]
    assert errors == [f"error answer_too_long: the orchestrator sent choice 0 more than {max_withdrawals_per_choice} "
                      "tokens_withdrawn frames, the most the protocol lets a choice have: no correct orchestrator "
                      "does, so the call was ended"], completed.stderr


async def test_hearth_bench_leaves_withdrawn_tokens_out_of_a_generation(nats_url):
    """A refuted step's tokens are no part of the answer bench compares with the monolithic model's."""
    scripted = await nats.connect(nats_url)
    frames = [{"type": "token_delta", "seq": 0, "text": "a", "token_id": 10},
              {"type": "token_delta", "seq": 1, "text": "X", "token_id": 66},
              {"type": "tokens_withdrawn", "seq": 2, "kept_tokens": 1, "shard_id": "m:0-1@x", "reason": "refuted"},
              {"type": "token_delta", "seq": 3, "text": "b", "token_id": 11},
              {"type": "done", "seq": 4, "finish_reason": "length",
               "usage": {"prompt_tokens": 1, "completion_tokens": 2}}]

    async def answer(msg) -> None:
        for frame in frames:
            await scripted.publish(msg.reply, json.dumps(frame).encode())

    client = await nats.connect(nats_url)
    try:
        await scripted.subscribe(CHAT_REQUEST_SUBJECT, queue="hearth-orchestrators", cb=answer)
        await flush_ordered(scripted)
        timing = await pipeline_generation(client, "scripted", "hello", 2)
    finally:
        await client.close()
        await scripted.close()
    assert timing.token_ids == [10, 11] and timing.tokens == 2
