"""Admission's cheap checks as a request arrives: a logit bias on a token the model does not have is refused naming
it, `max_tokens` must leave the prompt room in the context (left out, the answer takes what the context leaves, up to
the default), a prompt may not encode to a token beyond the embedding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hearth.protocol.chat import BadRequest, ChatRequest, default_max_tokens
from hearth.services.orchestrator.admission import admit_prompt, prompt_room


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
    encoded = {"fine": [1, 2, 99], "image": [1, 2, 150]}  # a tokenizer knowing 50 tokens more than the embedding
    head = SimpleNamespace(info=SimpleNamespace(vocab_size=100), has_tokenizer=True,
                           encode_prompt=lambda text: encoded[text])
    loaded = SimpleNamespace(head=head, context_length=64, token_bound=None, model_id="m")
    assert await admit_prompt(ChatRequest(prompt="fine", max_tokens=8), loaded) == [1, 2, 99]
    with pytest.raises(BadRequest, match="token 150, which model m has no embedding for"):
        await admit_prompt(ChatRequest(prompt="image", max_tokens=8), loaded)


def counted_model(prompt_tokens: int, context_length: int):
    """A model of `context_length` whose tokenizer encodes any prompt to `prompt_tokens` tokens."""
    head = SimpleNamespace(info=SimpleNamespace(vocab_size=100), has_tokenizer=True,
                           encode_prompt=lambda text: [1] * prompt_tokens)
    return SimpleNamespace(head=head, context_length=context_length, token_bound=None, model_id="m")


async def test_without_max_tokens_a_prompt_near_the_context_s_end_is_answered_with_what_is_left():
    # As OpenAI's API: left out, max_tokens is not the default held against the context but the answer's most.
    loaded = counted_model(60, 64)
    asked = ChatRequest(prompt="long")
    assert asked.max_tokens is None
    prompt_ids = await admit_prompt(asked, loaded)
    assert asked.fitted_to_context(len(prompt_ids), loaded.context_length).max_tokens == 4
    roomy = counted_model(60, 4096)
    assert asked.fitted_to_context(len(await admit_prompt(asked, roomy)), 4096).max_tokens == default_max_tokens


async def test_without_max_tokens_a_prompt_filling_the_context_is_refused_naming_the_prompt():
    with pytest.raises(BadRequest, match="field 'prompt': the prompt's 64 tokens leave no room for an answer") as \
            refused:
        await admit_prompt(ChatRequest(prompt="long"), counted_model(64, 64))
    assert (refused.value.param, refused.value.reason) == ("prompt", "context_exceeded")


async def test_an_explicit_max_tokens_that_does_not_fit_stays_refused_and_as_sent():
    with pytest.raises(BadRequest, match=r"prompt's 60 tokens plus max_tokens 8 = 68 exceed"):
        await admit_prompt(ChatRequest(prompt="long", max_tokens=8), counted_model(60, 64))
    sent = ChatRequest(prompt="long", max_tokens=3)
    assert sent.fitted_to_context(60, 64) is sent
