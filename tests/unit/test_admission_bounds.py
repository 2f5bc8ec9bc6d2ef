"""Admission's cheap checks as a request arrives: a logit bias on a token the model does not have is refused naming
it, `max_tokens` must leave the prompt room in the context."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hearth.protocol.chat import BadRequest, ChatRequest
from hearth.services.orchestrator.admission import prompt_room


def model(vocab_size: int = 100, context_length: int | None = 64):
    return SimpleNamespace(head=SimpleNamespace(info=SimpleNamespace(vocab_size=vocab_size)),
                           context_length=context_length)


def request(**fields) -> ChatRequest:
    return ChatRequest(prompt="hello", **fields)


def test_a_bias_on_a_token_beyond_the_vocabulary_is_refused_naming_it():
    with pytest.raises(BadRequest, match=r"logit_bias\.100'.*vocabulary of 100"):
        prompt_room(request(max_tokens=8, logit_bias={5: 1.0, 100: 2.0, 250: -1.0}), model())


def test_a_bias_within_the_vocabulary_leaves_the_room_the_context_gives():
    assert prompt_room(request(max_tokens=8, logit_bias={99: -100.0}), model()) == 56


def test_max_tokens_filling_the_context_is_refused():
    with pytest.raises(BadRequest, match="max_tokens"):
        prompt_room(request(max_tokens=64), model())
