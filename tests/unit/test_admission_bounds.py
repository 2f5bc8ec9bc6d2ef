"""Admission's cheap checks as a request arrives: a logit bias on a token the model does not have is refused naming
it, `max_tokens` must leave the prompt room in the context, a prompt may not encode to a token beyond the embedding."""

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


async def test_a_prompt_encoding_to_a_token_the_model_has_no_embedding_for_is_refused():
    from hearth.services.orchestrator.admission import admit_prompt

    encoded = {"fine": [1, 2, 99], "image": [1, 2, 150]}  # a tokenizer knowing 50 tokens more than the embedding
    head = SimpleNamespace(info=SimpleNamespace(vocab_size=100), has_tokenizer=True,
                           encode_prompt=lambda text: encoded[text])
    loaded = SimpleNamespace(head=head, context_length=64, token_bound=None, model_id="m")
    assert await admit_prompt(ChatRequest(prompt="fine", max_tokens=8), loaded) == [1, 2, 99]
    with pytest.raises(BadRequest, match="token 150, which model m has no embedding for"):
        await admit_prompt(ChatRequest(prompt="image", max_tokens=8), loaded)
