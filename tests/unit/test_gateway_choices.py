"""`n` > 1 through the gateway without a network: OpenAI bodies' `n` onto `llm.chat.request`, and the frames of
several choices (interleaved, each tagged with its `choice`) onto OpenAI's answers: a choice per answer with its own
text, finish reason, logprobs, tool call and withdrawals, whole and streamed (each choice's opening chunk, its text,
its ending chunk), read by the `openai` client too."""

from __future__ import annotations

import json

import openai

from hearth.protocol.chat_frames import (
    ChatFrame,
    ChoiceEnd,
    DoneFrame,
    PipelineAbortedFrame,
    TokenDeltaFrame,
    TokenLogprobs,
    TokensWithdrawnFrame,
    Usage,
)
from tests.unit.test_withdrawn_tokens import MODEL, chat_body, events_of, gateway  # noqa: F401 (a fixture)


def token(choice: int, text: str, token_id: int = 1, logprob: float | None = None) -> TokenDeltaFrame:
    logprobs = None if logprob is None else TokenLogprobs(text=text, logprob=logprob)
    return TokenDeltaFrame(seq=0, text=text, token_id=token_id, logprobs=logprobs, choice=choice)


def withdrawn(choice: int, kept_tokens: int) -> TokensWithdrawnFrame:
    return TokensWithdrawnFrame(seq=0, kept_tokens=kept_tokens, shard_id="m:0-1@liar", reason="refuted",
                                choice=choice)


def done(*endings: tuple[str, int]) -> DoneFrame:
    """The call's done frame: `endings[i]` is (finish reason, completion tokens) of choice i."""
    return DoneFrame(seq=0, finish_reason=endings[0][0],
                     usage=Usage(prompt_tokens=3, completion_tokens=sum(count for _, count in endings)),
                     choices=[ChoiceEnd(choice=choice, finish_reason=reason, completion_tokens=count)
                              for choice, (reason, count) in enumerate(endings)])


def numbered(*frames: ChatFrame) -> list[ChatFrame]:
    return [frame.model_copy(update={"seq": seq}) for seq, frame in enumerate(frames)]


# Three choices, interleaved: choice 0 "Hello", choice 1 "Hi!" (its "X" withdrawn: a cut by 1 applied to choice 0
# would leave "Hel"), choice 2 "Yo" cut by its length.
THREE_CHOICES = numbered(
    token(0, "Hel", logprob=-0.1), token(1, "Hi", logprob=-0.2), token(0, "lo", logprob=-0.3),
    token(2, "Yo", logprob=-0.4), token(1, "X", logprob=-9.0), withdrawn(1, 1), token(1, "!", logprob=-0.5),
    done(("stop", 2), ("stop", 2), ("length", 1)))


async def test_a_whole_chat_answer_has_a_choice_per_answer_each_with_its_own_ending_and_logprobs(gateway):
    http, scripted = gateway
    scripted.scripts.append(list(THREE_CHOICES))
    answer = (await http.post("/v1/chat/completions", json=chat_body(n=3, logprobs=True))).json()
    assert scripted.received[-1].n == 3
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in answer["choices"]] == [
        (0, "Hello", "stop"), (1, "Hi!", "stop"), (2, "Yo", "length")]
    assert [[entry["logprob"] for entry in c["logprobs"]["content"]] for c in answer["choices"]] == [
        [-0.1, -0.3], [-0.2, -0.5], [-0.4]]
    # A withdrawal happened: usage counts the tokens every choice's answer kept.
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


async def test_a_whole_completion_has_a_choice_per_answer(gateway):
    http, scripted = gateway
    scripted.scripts.append(numbered(token(1, "b"), token(0, "a"), done(("length", 1), ("stop", 1))))
    answer = (await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 2})).json()
    assert [(c["index"], c["text"], c["finish_reason"], c["logprobs"]) for c in answer["choices"]] == [
        (0, "a", "length", None), (1, "b", "stop", None)]
    assert answer["usage"]["completion_tokens"] == 2  # no withdrawal: the done frame's sum


def chunks_of(events: list[str]) -> list[dict]:
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


async def test_a_streamed_chat_answer_gives_each_choice_its_opening_text_and_ending(gateway):
    http, scripted = gateway
    # Choice 1's withdrawn token held its text back (no chunk): nothing its client saw is taken back, although
    # choice 0 had shown more tokens than choice 1 keeps.
    scripted.scripts.append(numbered(
        token(0, "Hel"), token(0, "lo"), token(1, "Hi"), token(0, "!"), token(1, ""), withdrawn(1, 1),
        token(1, "?"), done(("stop", 3), ("length", 2))))
    response = await http.post("/v1/chat/completions", json=chat_body(n=2, stream=True,
                                                                      stream_options={"include_usage": True}))
    chunks = chunks_of(events_of(response))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    per_choice: dict[int, list[dict]] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        per_choice[choice["index"]].append(choice)
    for index, text, reason in ((0, "Hello!", "stop"), (1, "Hi?", "length")):
        own = per_choice[index]
        assert own[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content") or "" for c in own[1:-1]) == text
        assert all(c["finish_reason"] is None for c in own[:-1])
        assert (own[-1]["delta"], own[-1]["finish_reason"]) == ({}, reason)
    # The chunks interleave as the tokens came: choice 1 opens after choice 0's first two tokens.
    order = [chunk["choices"][0]["index"] for chunk in chunks[:-1]]
    assert order[:5] == [0, 0, 0, 1, 1]


async def test_a_withdrawal_of_a_choice_s_streamed_text_ends_the_stream_with_an_error_event(gateway):
    http, scripted = gateway
    scripted.scripts.append(numbered(token(0, "Hello"), token(1, "Hi"), token(1, "XY"), withdrawn(1, 1),
                                     token(1, "!"), done(("stop", 1), ("stop", 2))))
    events = events_of(await http.post("/v1/chat/completions", json=chat_body(n=2, stream=True)))
    assert "[DONE]" not in events
    error = json.loads(events[-1])["error"]
    assert error["code"] == "tokens_withdrawn" and "first 1 tokens (2 characters)" in error["message"]


async def test_streamed_completions_offset_each_choice_s_logprobs_from_its_own_start(gateway):
    http, scripted = gateway
    scripted.scripts.append(numbered(token(0, "ab", logprob=-1.0), token(1, "xyz", logprob=-2.0),
                                     token(1, "w", logprob=-3.0), token(0, "c", logprob=-4.0),
                                     done(("stop", 2), ("length", 2))))
    events = events_of(await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 2,
                                                                 "logprobs": 0, "stream": True}))
    choices = [choice for chunk in chunks_of(events) for choice in chunk["choices"]]
    offsets = {index: [offset for c in choices if c["index"] == index and c["logprobs"]
                       for offset in c["logprobs"]["text_offset"]] for index in (0, 1)}
    assert offsets == {0: [0, 2], 1: [0, 3]}
    assert [(c["index"], c["finish_reason"]) for c in choices if c["finish_reason"]] == [(0, "stop"), (1, "length")]


LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
# Choice 0 calls the tool, choice 1 answers in words.
TOOL_AND_TEXT = numbered(token(0, '{"name":"lookup",'), token(1, "No"), token(0, '"arguments":{"q":1}}'),
                         token(1, " call"), done(("tool_calls", 2), ("stop", 2)))


async def test_each_choice_may_call_a_tool_of_its_own(gateway):
    http, scripted = gateway
    scripted.scripts.append(list(TOOL_AND_TEXT))
    answer = (await http.post("/v1/chat/completions", json=chat_body(n=2, tools=[LOOKUP]))).json()
    call, words = answer["choices"]
    assert call["finish_reason"] == "tool_calls" and call["message"]["content"] is None
    assert call["message"]["tool_calls"][0]["function"] == {"name": "lookup", "arguments": '{"q": 1}'}
    assert (words["finish_reason"], words["message"]["content"], "tool_calls" in words["message"]) == (
        "stop", "No call", False)

    scripted.scripts.append(list(TOOL_AND_TEXT))
    events = events_of(await http.post("/v1/chat/completions", json=chat_body(n=2, tools=[LOOKUP], stream=True)))
    choices = [choice for chunk in chunks_of(events) for choice in chunk["choices"]]
    fragments = [call for c in choices if c["index"] == 0 for call in c["delta"].get("tool_calls") or []]
    assert fragments[0]["function"]["name"] == "lookup"
    assert "".join(fragment["function"]["arguments"] for fragment in fragments) == '{"q":1}'
    assert "".join(c["delta"].get("content") or "" for c in choices if c["index"] == 1) == "No call"


async def test_a_choice_that_aborts_fails_the_call(gateway):
    http, scripted = gateway
    aborted = PipelineAbortedFrame(seq=0, code="shard_unavailable", reason="no hop left", choice=1)
    scripted.scripts.append(numbered(token(0, "Hi"), token(1, "Yo"), aborted))
    response = await http.post("/v1/chat/completions", json=chat_body(n=2))
    assert (response.status_code, response.json()["error"]["code"]) == (503, "shard_unavailable")
    scripted.scripts.append(numbered(token(0, "Hi"), token(1, "Yo"), aborted))
    events = events_of(await http.post("/v1/chat/completions", json=chat_body(n=2, stream=True)))
    assert json.loads(events[-1])["error"]["code"] == "shard_unavailable"


async def test_openai_s_client_reads_every_choice_whole_and_streamed(gateway):
    http, scripted = gateway
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=http, max_retries=0)
    asked = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3)
    scripted.scripts.append(list(THREE_CHOICES))
    answer = await client.chat.completions.create(**asked)
    assert [choice.message.content for choice in answer.choices] == ["Hello", "Hi!", "Yo"]
    scripted.scripts.append(numbered(*[frame for frame in THREE_CHOICES if not isinstance(frame, TokensWithdrawnFrame)
                                       and frame.model_dump().get("text") != "X"]))
    texts, reasons = ["", "", ""], [None, None, None]
    async for chunk in await client.chat.completions.create(**asked, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert (texts, reasons) == (["Hello", "Hi!", "Yo"], ["stop", "stop", "length"])
