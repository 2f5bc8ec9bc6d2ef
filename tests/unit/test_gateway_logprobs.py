"""logprobs, penalties and logit_bias on the wire and through the gateway: `llm.chat.request` bounds them, the
OpenAI bodies map onto them (chat: `logprobs` + `top_logprobs`, completions: `logprobs` N), token_delta frames carry
log-probabilities only when asked, and answers carry OpenAI's `logprobs` objects, streamed chunks too."""

from __future__ import annotations

import json

import pytest

from hearth.protocol.chat import BadRequest, ChatRequest, parse_chat_request
from hearth.protocol.chat_frames import DoneFrame, TokenAlternative, TokenDeltaFrame, TokenLogprobs, Usage
from hearth.services.gateway.answers import ChatShape, CompletionShape
from hearth.services.gateway.openai_models import ChatCompletionRequest, CompletionRequest

DONE = DoneFrame(seq=3, finish_reason="length", usage=Usage(prompt_tokens=4, completion_tokens=2))
STEPS = [
    TokenLogprobs(text="hé", logprob=-0.25, top_logprobs=[TokenAlternative(token_id=5, text="hé", logprob=-0.25),
                                                          TokenAlternative(token_id=9, text="x", logprob=-2.0)]),
    TokenLogprobs(text=" yo", logprob=-1.5, top_logprobs=[TokenAlternative(token_id=7, text=" a", logprob=-0.5),
                                                          TokenAlternative(token_id=8, text=" yo", logprob=-1.5)]),
]


def request(**fields) -> bytes:
    return json.dumps({"prompt": "hi", **fields}).encode()


def test_the_options_default_to_off_and_are_read_from_the_wire():
    plain = parse_chat_request(request())
    assert (plain.logprobs, plain.top_logprobs, plain.presence_penalty, plain.frequency_penalty,
            plain.repetition_penalty, plain.logit_bias) == (False, 0, 0.0, 0.0, 1.0, {})
    asked = parse_chat_request(request(logprobs=True, top_logprobs=20, presence_penalty=-2, frequency_penalty=2,
                                       repetition_penalty=1.3, logit_bias={"17": -100, "3": 100}))
    assert (asked.top_logprobs, asked.logit_bias, asked.repetition_penalty) == (20, {17: -100.0, 3: 100.0}, 1.3)


@pytest.mark.parametrize("fields, named", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 11}, "repetition_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"-1": 1}}, "logit_bias.-1"),
    ({"logit_bias": {"word": 1}}, "logit_bias.word"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
])
def test_out_of_bounds_options_are_bad_requests_naming_the_field(fields, named):
    with pytest.raises(BadRequest, match=named.replace(".", r"\.")):
        parse_chat_request(request(**fields))


def test_token_delta_frames_carry_logprobs_only_when_asked():
    plain = json.loads(TokenDeltaFrame(seq=1, text="a", token_id=3).model_dump_json())
    assert "logprobs" not in plain
    frame = TokenDeltaFrame(seq=1, text="hé", token_id=5, logprobs=STEPS[0])
    assert json.loads(frame.model_dump_json())["logprobs"]["top_logprobs"][1] == {"token_id": 9, "text": "x",
                                                                                  "logprob": -2.0}


def chat(**fields) -> ChatRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 **fields}).to_chat_request()


def test_openai_bodies_map_onto_the_options():
    mapped = chat(logprobs=True, top_logprobs=3, presence_penalty=0.5, frequency_penalty=0.25,
                  repetition_penalty=1.1, logit_bias={"42": -100})
    assert (mapped.logprobs, mapped.top_logprobs, mapped.presence_penalty, mapped.frequency_penalty,
            mapped.repetition_penalty, mapped.logit_bias) == (True, 3, 0.5, 0.25, 1.1, {42: -100.0})
    assert (chat().logprobs, chat().top_logprobs, chat().logit_bias) == (False, 0, {})
    completion = CompletionRequest.model_validate({"prompt": "hi", "logprobs": 2}).to_chat_request()
    assert (completion.logprobs, completion.top_logprobs) == (True, 2)
    sampled_only = CompletionRequest.model_validate({"prompt": "hi", "logprobs": 0}).to_chat_request()
    assert (sampled_only.logprobs, sampled_only.top_logprobs) == (True, 0)
    with pytest.raises(BadRequest, match="presence_penalty"):
        chat(presence_penalty=3)
    with pytest.raises(BadRequest, match="top_logprobs"):
        chat(top_logprobs=2)


def test_chat_answers_carry_openai_s_logprobs_objects():
    whole = ChatShape(id="c", model="m").whole("hé yo", DONE, STEPS).model_dump()
    content = whole["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "hé", "logprob": -0.25, "bytes": [104, 195, 169], "top_logprobs": [
        {"token": "hé", "logprob": -0.25, "bytes": [104, 195, 169]}, {"token": "x", "logprob": -2.0, "bytes": [120]}]}
    assert [entry["token"] for entry in content] == ["hé", " yo"]
    assert ChatShape(id="c", model="m").whole("hé yo", DONE).model_dump()["choices"][0]["logprobs"] is None
    chunk = ChatShape(id="c", model="m").text("", STEPS[1]).model_dump()
    assert chunk["choices"][0]["delta"] == {"content": ""}
    assert chunk["choices"][0]["logprobs"]["content"][0]["logprob"] == -1.5


def test_completion_answers_carry_tokens_offsets_and_top_logprobs_streamed_too():
    whole = CompletionShape(id="c", model="m").whole("hé yo", DONE, STEPS).model_dump()["choices"][0]["logprobs"]
    assert whole == {"tokens": ["hé", " yo"], "token_logprobs": [-0.25, -1.5],
                     "top_logprobs": [{"hé": -0.25, "x": -2.0}, {" a": -0.5, " yo": -1.5}], "text_offset": [0, 2]}
    shape = CompletionShape(id="c", model="m")
    streamed = [shape.text(step.text, step).model_dump()["choices"][0]["logprobs"] for step in STEPS]
    assert [chunk["text_offset"] for chunk in streamed] == [[0], [2]]
    assert shape.text("plain").model_dump()["choices"][0]["logprobs"] is None
