"""A hostile orchestrator cannot make a client hold or stream an answer past its request's bound (AnswerBound): a
choice of more token frames than `max_tokens`, or of more text than `max_tokens` tokens can make, or a token of a
choice never asked for, ends the call; the gateway answers 502 (a stream: its error event), `hearth chat` one error
line and exit code 1, each with a WARNING naming the orchestrator. An honest answer up to the bound is left whole."""

from __future__ import annotations

import json
import logging

import pytest

from hearth.protocol.chat import ChatRequest
from hearth.protocol.chat_frames import (
    ChoiceEnd, DoneFrame, TokenDeltaFrame, TokensWithdrawnFrame, Usage, max_withdrawals_per_choice,
)
from hearth.services.client.answer_bound import AnswerBound, AnswerTooLong, max_answer_text_bytes
from hearth.services.client.command import EXIT_ERROR, ChatPrinter
from tests.unit.test_withdrawn_tokens import (  # noqa: F401 (gateway is a fixture)
    chat_body, done, events_of, gateway, streamed_text, token, withdrawn,
)


def of_choice(seq: int, choice: int, text: str) -> TokenDeltaFrame:
    return TokenDeltaFrame(seq=seq, text=text, token_id=seq, choice=choice)


def tokens(count: int, text: str = "a", first_seq: int = 0) -> list[TokenDeltaFrame]:
    return [token(first_seq + index, text) for index in range(count)]


def test_an_answer_of_max_tokens_frames_stands_and_one_more_frame_ends_it():
    bound = AnswerBound(max_tokens=3)
    for frame in tokens(3):
        bound.take(frame)
    with pytest.raises(AnswerTooLong, match="more token frames than the request's max_tokens 3"):
        bound.take(token(3, "a"))


def test_a_frame_may_carry_held_back_text_but_a_choice_s_text_stays_within_its_bytes():
    """One frame may carry several tokens' text (held back for a stop string, or a character split across
    tokens): only the choice's whole text is bounded."""
    limit = max_answer_text_bytes(4)
    bound = AnswerBound(max_tokens=4)
    bound.take(token(0, ""))
    bound.take(token(1, "é" * (limit // 2)))  # two bytes a character: exactly the bound
    with pytest.raises(AnswerTooLong, match=f"more than {limit} bytes of text"):
        bound.take(token(2, "x"))
    # One frame of megabytes is refused on its own.
    with pytest.raises(AnswerTooLong, match="bytes of text"):
        AnswerBound(max_tokens=8192).take(token(0, "x" * 8_000_000))


def test_withdrawn_tokens_leave_the_answer_and_its_text():
    bound = AnswerBound(max_tokens=3)
    text = "b" * (max_answer_text_bytes(3) // 3)
    for frame in [token(0, text), token(1, text), token(2, text), withdrawn(3, 1), token(4, text), token(5, text)]:
        bound.take(frame)
    with pytest.raises(AnswerTooLong):
        bound.take(token(6, "c"))


def resent(withdrawals: int, text: str = "ok") -> list[TokenDeltaFrame | TokensWithdrawnFrame]:
    """A token, then `withdrawals` times: it taken back and sent again (each withdrawal within max_tokens 1)."""
    frames: list[TokenDeltaFrame | TokensWithdrawnFrame] = [token(0, text)]
    for round_ in range(withdrawals):
        frames += [withdrawn(2 * round_ + 1, 0), token(2 * round_ + 2, text)]
    return frames


def test_a_choice_may_have_the_protocol_s_withdrawals_and_one_more_ends_it():
    bound = AnswerBound(max_tokens=1, choices=2)
    for frame in resent(max_withdrawals_per_choice):
        bound.take(frame)
    # Each choice has withdrawals of its own.
    bound.take(TokensWithdrawnFrame(seq=100, kept_tokens=0, shard_id="s", reason="r", choice=1))
    with pytest.raises(AnswerTooLong, match=f"sent choice 0 more than {max_withdrawals_per_choice} tokens_withdrawn "
                                            "frames"):
        bound.take(withdrawn(101, 0))


def test_each_of_n_choices_has_its_own_bound_and_a_choice_not_asked_for_has_none():
    bound = AnswerBound(max_tokens=2, choices=2)
    for frame in [of_choice(0, 0, "a"), of_choice(1, 1, "b"), of_choice(2, 0, "c"), of_choice(3, 1, "d")]:
        bound.take(frame)
    bound.take(TokensWithdrawnFrame(seq=4, kept_tokens=1, shard_id="s", reason="r", choice=1))
    bound.take(of_choice(5, 1, "e"))
    with pytest.raises(AnswerTooLong, match="sent choice 0 more token frames"):
        bound.take(of_choice(6, 0, "f"))
    with pytest.raises(AnswerTooLong, match="sent choice 2 a token, but the request asked for 2 choices"):
        AnswerBound(max_tokens=2, choices=2).take(of_choice(0, 2, "g"))


# --- the gateway -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("frames", [tokens(5), [token(0, "x" * (max_answer_text_bytes(4) + 1))]],
                         ids=["frames", "text"])
async def test_the_gateway_answers_502_to_an_answer_past_max_tokens(gateway, caplog, frames):
    http, scripted = gateway
    scripted.scripts.append([*frames, done(len(frames), len(frames))])
    with caplog.at_level(logging.WARNING, logger="hearth.services.client.answer_bound"):
        response = await http.post("/v1/chat/completions", json=chat_body(max_tokens=4))
    assert response.status_code == 502
    error = response.json()["error"]
    assert (error["code"], error["type"]) == ("internal_error", "server_error")
    assert "sent choice 0 more" in error["message"]
    request_id = scripted.received[-1].request_id
    assert [record.levelno for record in caplog.records] == [logging.WARNING]
    assert request_id in caplog.text and "the orchestrator of the queue group" in caplog.text


async def test_the_gateway_answers_502_to_an_answer_withdrawn_more_often_than_the_protocol_allows(gateway):
    http, scripted = gateway
    frames = resent(max_withdrawals_per_choice + 1)
    scripted.scripts.append([*frames, done(len(frames), 1)])
    response = await http.post("/v1/chat/completions", json=chat_body(max_tokens=1))
    assert response.status_code == 502
    assert f"more than {max_withdrawals_per_choice} tokens_withdrawn frames" in response.json()["error"]["message"]


async def test_a_gateway_stream_ends_with_an_error_event_before_any_text_past_the_bound(gateway):
    http, scripted = gateway
    scripted.scripts.append([*tokens(4, "ok"), token(4, "LEAK"), done(5, 5)])
    response = await http.post("/v1/chat/completions", json=chat_body(max_tokens=4, stream=True))
    events = events_of(response)
    assert response.status_code == 200 and "[DONE]" not in events
    assert json.loads(events[-1])["error"]["code"] == "internal_error"
    assert streamed_text(events) == "ok" * 4


async def test_the_gateway_answers_every_choice_up_to_its_bound_whole(gateway):
    http, scripted = gateway
    frames = [of_choice(seq, seq % 2, "x" * 100) for seq in range(8)]
    scripted.scripts.append([*frames, DoneFrame(
        seq=8, finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=8),
        choices=[ChoiceEnd(choice=choice, finish_reason="length", completion_tokens=4) for choice in (0, 1)])])
    answer = (await http.post("/v1/chat/completions", json=chat_body(max_tokens=4, n=2))).json()
    assert [choice["message"]["content"] for choice in answer["choices"]] == ["x" * 400] * 2


# --- hearth chat -------------------------------------------------------------------------------------------------


def test_hearth_chat_ends_an_answer_past_its_bound_with_one_line_and_exit_code_1(capsys, caplog):
    request = ChatRequest(prompt="p", max_tokens=2)
    printer = ChatPrinter.of(request, asked_first="node-a")
    with caplog.at_level(logging.WARNING, logger="hearth.services.client.answer_bound"):
        codes = [printer.show(frame) for frame in tokens(3, "ok")]
    out, err = capsys.readouterr()
    assert codes == [None, None, EXIT_ERROR]
    assert out == "okok\n"
    # (The WARNING goes to stderr too where logging is set up, as `hearth`'s commands set it up.)
    errors = [line for line in err.splitlines() if "WARNING" not in line]
    assert errors == ["error answer_too_long: the orchestrator sent choice 0 more token frames than the request's "
                      "max_tokens 2: no correct orchestrator does, so the call was ended"]
    assert request.request_id in caplog.text and "orchestrator node-a" in caplog.text


def test_hearth_chat_json_lines_stop_at_the_bound_too(capsys):
    printer = ChatPrinter.of(ChatRequest(prompt="p", max_tokens=1))
    assert printer.past_bound(token(0, "a")) is None
    assert printer.past_bound(token(1, "b")) == EXIT_ERROR


def test_hearth_chat_ends_a_call_withdrawn_once_too_often_before_printing_its_text_again(capsys):
    """An orchestrator that sends the whole allowance, withdraws it and sends it again without end cannot make
    `hearth chat` print the kept text again without end."""
    printer = ChatPrinter.of(ChatRequest(prompt="p", max_tokens=1))
    frames = resent(max_withdrawals_per_choice + 1)
    codes = [printer.show(frame) for frame in frames[:-1]]  # the call ends at the withdrawal past the bound
    out, err = capsys.readouterr()
    assert codes == [None] * (len(frames) - 2) + [EXIT_ERROR]
    assert out.count("ok") == max_withdrawals_per_choice + 1
    assert err.splitlines()[-1].startswith(f"error answer_too_long: the orchestrator sent choice 0 more than "
                                           f"{max_withdrawals_per_choice} tokens_withdrawn frames")
