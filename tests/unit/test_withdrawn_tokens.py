"""Withdrawn tokens on the client side (issue 28): a tokens_withdrawn frame takes back the tokens after its
`kept_tokens` in ChatResult, in `hearth chat`'s and the demo's printing, and in the gateway's answers (a whole answer
leaves them out; a stream whose chunks carried them ends with an error event); and the gateway's `hearth.verify`
and `hearth.quantization` options onto `params`. The gateway runs over scripted frame streams, without a network."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import httpx2
import openai
import pytest

from hearth.protocol.chat import ChatRequest
from hearth.protocol.discovery import ModelsReply, ServedModel
from hearth.protocol.chat_frames import (
    ChatFrame,
    DoneFrame,
    ErrorFrame,
    ShardFailoverFrame,
    TokenDeltaFrame,
    TokenLogprobs,
    TokensWithdrawnFrame,
    Usage,
)
from hearth.services.client.chat import ChatResult
from hearth.services.client.command import EXIT_ERROR, ChatPrinter
from hearth.services.common.config import HearthSettings
from hearth.services.devtools.demo import _AnswerView
from hearth.services.gateway.app import create_app
from hearth.services.gateway.mesh import Gateway, MeshCall

MODEL = "scripted"


def token(seq: int, text: str, token_id: int | None = None, logprob: float | None = None) -> TokenDeltaFrame:
    logprobs = None if logprob is None else TokenLogprobs(text=text, logprob=logprob)
    return TokenDeltaFrame(seq=seq, text=text, token_id=seq if token_id is None else token_id, logprobs=logprobs)


def withdrawn(seq: int, kept_tokens: int) -> TokensWithdrawnFrame:
    return TokensWithdrawnFrame(seq=seq, kept_tokens=kept_tokens, shard_id="m:0-1@liar", reason="step 2 refuted")


def failover(seq: int, resumed_at_token: int) -> ShardFailoverFrame:
    return ShardFailoverFrame(seq=seq, failed_shard_id="m:0-1@liar", replacement_hops=["m:0-1@honest"],
                              resumed_at_token=resumed_at_token)


def done(seq: int, completion_tokens: int) -> DoneFrame:
    return DoneFrame(seq=seq, finish_reason="stop", usage=Usage(prompt_tokens=3, completion_tokens=completion_tokens))


# "Hel" "lo" "X" "Y" sent; a check refutes the step of "X": the answer is "Hel" "lo" and goes on with " w" "orld".
ONE_WITHDRAWAL = [token(0, "Hel", 10), token(1, "lo", 11), token(2, "X", 12), token(3, "Y", 13), withdrawn(4, 2),
                  failover(5, 2), token(6, " w", 14), token(7, "orld", 15), done(8, 6)]


def test_chat_result_leaves_withdrawn_tokens_out():
    result = ChatResult(frames=list(ONE_WITHDRAWAL))
    assert (result.text, result.token_ids) == ("Hello world", [10, 11, 14, 15])
    assert [frame.kept_tokens for frame in result.withdrawals] == [2]
    assert result.ok and len(result.frames_of("token_delta")) == 6


def test_each_withdrawal_counts_the_answer_as_it_stands():
    frames = [token(0, "a"), token(1, "b"), token(2, "c"), withdrawn(3, 1), token(4, "B"), token(5, "C"),
              token(6, "D"), withdrawn(7, 2), token(8, "x"), withdrawn(9, 0), token(10, "z"), done(11, 1)]
    assert ChatResult(frames=frames).text == "z"
    assert ChatResult(frames=frames[:7]).text == "aBCD"
    assert ChatResult(frames=frames[:9]).text == "aBx"
    # Keeping more tokens than were sent keeps them all.
    assert ChatResult(frames=[token(0, "a"), withdrawn(1, 5), done(2, 1)]).text == "a"


def test_hearth_chat_marks_a_withdrawal_and_prints_the_kept_text_again(capsys):
    printer = ChatPrinter()
    codes = [printer.show(frame) for frame in ONE_WITHDRAWAL]
    out, err = capsys.readouterr()
    assert codes == [None] * len(ONE_WITHDRAWAL)
    # The failover's line ends the text's line too, as it always did.
    assert out == "HelloXY\nHello\n world\n"
    assert "[tokens_withdrawn: the 2 tokens after token 2 are taken back (m:0-1@liar: step 2 refuted)" in err
    assert printer.show(ErrorFrame(seq=9, code="internal_error", message="m")) == EXIT_ERROR


class _DemoStandIn:
    def _summarise(self, *_args) -> None:
        pass


def test_the_demo_marks_a_withdrawal_and_prints_the_kept_text_again(capsys):
    view = _AnswerView(_DemoStandIn())
    assert [view.show(frame) for frame in ONE_WITHDRAWAL][-1] is True
    out = capsys.readouterr().out
    assert "2 tokens after token 2 withdrawn: liar [layers 0-1] refuted (step 2 refuted)" in out
    assert out.startswith("HelloXY\n[[") and "the answer so far:]]\nHello [[failover" in out
    assert out.rstrip().endswith("]]  world")


# --- the gateway over scripted frame streams -------------------------------------------------------------------


async def _frames(frames: list[ChatFrame]) -> AsyncIterator[ChatFrame]:
    for frame in frames:
        yield frame


class ScriptedCall(MeshCall):
    """A MeshCall whose frames are scripted rather than streamed from an orchestrator."""

    def __init__(self, request: ChatRequest, frames: list[ChatFrame]) -> None:
        self.request = request
        self.started = time.perf_counter()
        self._frames = _frames(frames)


class ScriptedGateway(Gateway):
    """A Gateway answering each call with the next script and the model list with MODEL, with no network."""

    def __init__(self) -> None:
        super().__init__(nc=None, settings=HearthSettings(), keyring=None)
        self.scripts: list[list[ChatFrame]] = []
        self.received: list[ChatRequest] = []

    async def models(self) -> ModelsReply:
        self._known_models = {MODEL}
        return ModelsReply(models=[ServedModel(id=MODEL, total_layers=2, complete=True)], default_model=MODEL)

    def call(self, request: ChatRequest, caller) -> MeshCall:
        self.received.append(request)
        return ScriptedCall(request, self.scripts.pop(0))


@pytest.fixture
async def gateway():
    scripted = ScriptedGateway()
    transport = httpx2.ASGITransport(app=create_app(scripted))
    async with httpx2.AsyncClient(transport=transport, base_url="http://gateway") as http:
        yield http, scripted


def chat_body(**changes) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **changes}


def events_of(response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.text.splitlines() if line]


def streamed_text(events: list[str]) -> str:
    chunks = [json.loads(event) for event in events if event != "[DONE]"]
    return "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk.get("choices"))


async def test_a_whole_answer_leaves_withdrawn_tokens_out_of_text_usage_and_logprobs(gateway):
    http, scripted = gateway
    with_logprobs = [token(0, "Hel", logprob=-0.1), token(1, "lo", logprob=-0.2), token(2, "X", logprob=-9.0),
                     withdrawn(3, 2), failover(4, 2), token(5, "!", logprob=-0.3), done(6, 4)]
    scripted.scripts.append(with_logprobs)
    answer = (await http.post("/v1/chat/completions", json=chat_body(logprobs=True))).json()
    assert answer["choices"][0]["message"]["content"] == "Hello!"
    assert [entry["logprob"] for entry in answer["choices"][0]["logprobs"]["content"]] == [-0.1, -0.2, -0.3]
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    scripted.scripts.append(with_logprobs)
    completion = (await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "logprobs": 0})).json()
    assert completion["choices"][0]["text"] == "Hello!"
    assert completion["choices"][0]["logprobs"]["tokens"] == ["Hel", "lo", "!"]
    assert completion["choices"][0]["logprobs"]["text_offset"] == [0, 3, 5]
    assert completion["usage"]["completion_tokens"] == 3


async def test_without_a_withdrawal_usage_is_the_orchestrator_s(gateway):
    http, scripted = gateway
    scripted.scripts.append([token(0, "Hi"), failover(1, 1), token(2, "!"), done(3, 7)])
    answer = (await http.post("/v1/chat/completions", json=chat_body())).json()
    assert (answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"]) == ("Hi!", 7)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", chat_body(stream=True)),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True}),
])
async def test_a_stream_whose_chunks_carried_withdrawn_tokens_ends_with_an_error_event(gateway, path, body):
    http, scripted = gateway
    scripted.scripts.append(list(ONE_WITHDRAWAL))
    response = await http.post(path, json=body)
    events = events_of(response)
    assert response.status_code == 200 and "[DONE]" not in events
    error = json.loads(events[-1])["error"]
    assert (error["code"], error["type"]) == ("tokens_withdrawn", "server_error")
    assert "first 2 tokens (5 characters)" in error["message"] and "m:0-1@liar" in error["message"]
    texts = [choice.get("text") or choice.get("delta", {}).get("content") or ""
             for event in events[:-1] for choice in json.loads(event)["choices"]]
    assert "".join(texts) == "HelloXY"  # nothing after the withdrawal was streamed


async def test_a_withdrawal_of_tokens_no_chunk_carried_leaves_the_stream_whole(gateway):
    http, scripted = gateway
    # The withdrawn token held its text back (no chunk): nothing the client saw is taken back.
    scripted.scripts.append([token(0, "Hel"), token(1, "lo"), token(2, ""), withdrawn(3, 2), failover(4, 2),
                             token(5, "!"), done(6, 4)])
    events = events_of(await http.post("/v1/chat/completions", json=chat_body(stream=True)))
    assert events[-1] == "[DONE]" and streamed_text(events) == "Hello!"


@pytest.mark.parametrize(("option", "values", "absent"), [
    ("verify", ("none", "sampled", "all", "vote"), "sampled"),
    ("quantization", ("none", "int8", "int4", "int4/g64"), None)])
async def test_each_hearth_option_maps_onto_its_params_field(gateway, option, values, absent):
    http, scripted = gateway
    for value in values:
        scripted.scripts.append([token(0, "Hi"), done(1, 1)])
        response = await http.post("/v1/chat/completions", json=chat_body(hearth={option: value}))
        assert response.status_code == 200 and getattr(scripted.received[-1].params, option) == value
    scripted.scripts.append([token(0, "Hi"), done(1, 1)])
    await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "hearth": {option: values[-1]}})
    assert getattr(scripted.received[-1].params, option) == values[-1]
    scripted.scripts.append([token(0, "Hi"), done(1, 1)])
    await http.post("/v1/chat/completions", json=chat_body())
    assert getattr(scripted.received[-1].params, option) == absent


@pytest.mark.parametrize("hearth, param", [
    ({"quantization": "int7"}, "hearth.quantization"),
    ({"quantization": "int4/g0"}, "hearth.quantization"),
    ({"verify": "most"}, "hearth.verify"),
    ({"verify": 1}, "hearth.verify"),
    ("all", "hearth"),
])
async def test_a_bad_hearth_option_is_a_400_naming_it(gateway, hearth, param):
    http, scripted = gateway
    response = await http.post("/v1/chat/completions", json=chat_body(hearth=hearth))
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["param"]) == (400, "bad_request", param)
    assert param in error["message"] and not scripted.received


async def test_openai_s_client_raises_on_a_withdrawal_and_sends_hearth_options_as_extra_body(gateway):
    http, scripted = gateway
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=http, max_retries=0)
    scripted.scripts.append(list(ONE_WITHDRAWAL))
    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  stream=True, extra_body={"hearth": {"verify": "vote"}})
    shown = []
    with pytest.raises(openai.APIError) as ended:
        async for chunk in stream:
            shown.append(chunk.choices[0].delta.content or "")
    assert "".join(shown) == "HelloXY" and ended.value.code == "tokens_withdrawn"
    assert scripted.received[-1].params.verify == "vote"
