"""The Python client's answers per choice (`n` > 1): each choice's text and token ids from interleaved frames, a
withdrawal applied to its own choice only, the first choice's answer as `ChatResult.text`, and `hearth chat --n`
printing each choice under its label; `hearth chat --quantization`."""

from __future__ import annotations

from hearth.protocol.chat import ChatRequest
from hearth.protocol.chat_frames import ChoiceEnd, DoneFrame, TokenDeltaFrame, TokensWithdrawnFrame, Usage
from hearth.services.client.chat import ChatResult, answer_tokens
from hearth.services.client.command import ChatPrinter


def token(seq: int, choice: int, text: str, token_id: int) -> TokenDeltaFrame:
    return TokenDeltaFrame(seq=seq, text=text, token_id=token_id, choice=choice)


DONE = DoneFrame(seq=8, finish_reason="stop", usage=Usage(prompt_tokens=2, completion_tokens=5),
                 choices=[ChoiceEnd(choice=0, finish_reason="stop", completion_tokens=2),
                          ChoiceEnd(choice=1, finish_reason="length", completion_tokens=2),
                          ChoiceEnd(choice=2, finish_reason="stop", completion_tokens=1)])
# Choice 1's "X" is withdrawn; applied to choice 0 instead, it would cut "lo".
FRAMES = [token(0, 0, "Hel", 10), token(1, 1, "Hi", 20), token(2, 0, "lo", 11), token(3, 1, "X", 21),
          TokensWithdrawnFrame(seq=4, kept_tokens=1, shard_id="s", reason="refuted", choice=1),
          token(5, 1, "!", 22), token(6, 2, "Yo", 30), DONE]


def test_each_choice_has_its_own_answer_and_the_first_is_the_result_s_text():
    result = ChatResult(frames=list(FRAMES))
    assert result.choice_texts() == ["Hello", "Hi!", "Yo"]
    assert result.choice_token_ids() == [[10, 11], [20, 22], [30]]
    assert (result.text, result.token_ids) == ("Hello", [10, 11])
    assert answer_tokens(FRAMES, choice=1).text == "Hi!"
    # Frames of a call that asked for one choice name none: the whole answer is choice 0's.
    single = ChatResult(frames=[token(0, 0, "a", 1), DoneFrame(seq=1, finish_reason="stop",
                                                               usage=Usage(prompt_tokens=1, completion_tokens=1))])
    assert single.choice_texts() == ["a"]


def test_a_choice_tag_is_left_out_of_the_wire_for_the_first_choice_only():
    assert "choice" not in token(0, 0, "a", 1).model_dump_json()
    assert '"choice":2' in token(0, 2, "a", 1).model_dump_json()
    assert ChatRequest(prompt="p", n=3).n == 3


def test_hearth_chat_prints_each_choice_under_its_label_once_done(capsys):
    printer = ChatPrinter(choices=3)
    assert [printer.show(frame) for frame in FRAMES] == [None] * len(FRAMES)
    out, err = capsys.readouterr()
    assert out == ("[choice 0: stop, 2 tokens]\nHello\n[choice 1: length, 2 tokens]\nHi!\n"
                   "[choice 2: stop, 1 tokens]\nYo\n")
    assert "tokens of choice 1 after token 1 are taken back" in err and "[stop: 5 tokens" in err


def test_hearth_chat_asks_for_the_scheme_it_is_given_and_refuses_a_malformed_one_in_one_line(monkeypatch):
    """`hearth chat --quantization` sets the request's params.quantization; a scheme that is not one is refused
    in one line before anything is sent."""
    from typer.testing import CliRunner

    from hearth.services.cli import app
    from hearth.services.client import command

    sent: list[ChatRequest] = []

    async def chat(nats_url, request, **_):
        sent.append(request)
        return 0

    monkeypatch.setattr(command, "_chat", chat)  # what would be published, without a broker
    options = ["--nats", "nats://127.0.0.1:9", "--insecure"]
    asked = CliRunner().invoke(app, ["chat", "hi", "--quantization", "int4/g32", *options])
    assert asked.exit_code == 0, asked.output
    assert [request.params.quantization for request in sent] == ["int4/g32"]

    refused = CliRunner().invoke(app, ["chat", "hi", "--quantization", "int7", *options])
    assert refused.exit_code == 2, refused.output  # the caller's input, as a usage error
    lines = [line for line in refused.output.splitlines() if "bad_request" in line]
    assert len(lines) == 1 and "quantization" in lines[0] and "Traceback" not in refused.output
    assert len(sent) == 1


def test_a_request_the_mesh_refuses_as_not_valid_ends_with_the_input_error_code_and_other_errors_keep_theirs():
    """`bad_request` from the mesh (a model it does not serve, a prompt past the context) is the caller's input: exit
    code 2, as a request refused before it is sent; every other error keeps 1, and `orchestrator_gone` 2."""
    from hearth.protocol.chat_frames import ErrorFrame, PipelineAbortedFrame

    def ended(frame) -> int | None:
        return ChatPrinter().show(frame)

    assert ended(ErrorFrame(seq=0, code="bad_request", message="no model 'x'", param="model")) == 2
    assert ended(ErrorFrame(seq=0, code="overloaded", message="queue full", retry_after_s=1.0)) == 1
    assert ended(ErrorFrame(seq=0, code="internal_error", message="bug")) == 1
    assert ended(ErrorFrame(seq=0, code="orchestrator_gone", message="no orchestrator")) == 2
    assert ended(PipelineAbortedFrame(seq=0, code="shard_unavailable", reason="layers 3-5 uncovered")) == 1
