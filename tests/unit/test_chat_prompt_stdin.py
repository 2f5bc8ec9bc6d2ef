"""`hearth chat -`: the prompt is read from stdin, never put on the command line, where every user of the machine
sees it (ps, /proc/PID/cmdline) and the shell's history keeps it."""

from __future__ import annotations

import io

from hearth.protocol.chat import max_prompt_chars
from hearth.services.client import command
from hearth.services.client.command import EXIT_BAD_REQUEST, prompt_from_stdin, run_chat_command


def test_the_prompt_is_all_of_stdin_or_with_interactive_its_first_line(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("ZQXJ a secret\\nsecond line\n"))
    assert prompt_from_stdin(False) == "ZQXJ a secret\\nsecond line"
    monkeypatch.setattr("sys.stdin", io.StringIO("first turn\nsecond turn\n"))
    assert prompt_from_stdin(True) == "first turn"
    assert command.sys.stdin.readline() == "second turn\n", "the later turns stay for the conversation"


def test_a_dash_sends_stdin_as_the_prompt(monkeypatch):
    sent = []
    monkeypatch.setattr("sys.stdin", io.StringIO("ZQXJ from stdin\n"))

    async def chat(nats_url, request, **options):
        sent.append(request)
        return 0

    monkeypatch.setattr(command, "_chat", chat)
    assert run_chat_command("nats://127.0.0.1:1", prompt="-", model=None, max_tokens=1, temperature=0.0, seed=None,
                            raw=True, as_json=False, choices=1) == 0
    assert [request.prompt for request in sent] == ["ZQXJ from stdin"]


def test_a_prompt_from_stdin_past_the_bound_is_refused_unread_beyond_it(monkeypatch):
    stdin = io.StringIO("x" * (max_prompt_chars + 10))
    monkeypatch.setattr("sys.stdin", stdin)
    assert run_chat_command("nats://127.0.0.1:1", prompt="-", model=None, max_tokens=1, temperature=0.0, seed=None,
                            raw=True, as_json=False, choices=1) == EXIT_BAD_REQUEST
    assert stdin.tell() == max_prompt_chars + 1
