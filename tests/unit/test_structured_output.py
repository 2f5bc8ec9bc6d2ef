"""Grammar-constrained output at the head (hearth/inference/grammar.py, hearth/services/orchestrator/constrained.py, the
call's matcher in hearth/services/orchestrator/call.py) on a random-weight model's vocabulary: JSON valid against its
schema from logits that know nothing, a call that ends when its grammar is complete, `length` when max_tokens cuts it, a
tool call's arguments, text under `auto`, and a matcher that goes back with the call."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from hearth.inference import load_head
from hearth.inference.sampling import SamplingParams, sample_token
from hearth.protocol.chat import BadRequest, ChatParams, ChatRequest
from hearth.services.devtools.random_models import random_checkpoint
from hearth.services.orchestrator.call import Call
from hearth.services.orchestrator.catalog import LoadedModel
from hearth.services.orchestrator.constrained import output_grammar

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12}, "count": {"type": "integer"},
                         "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                               "maxItems": 3}},
          "required": ["name", "count", "ok", "tags"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                             "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "t1 t2 t3"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> LoadedModel:
    path = random_checkpoint("random:tiny", cache_dir=tmp_path_factory.mktemp("random-cache"))
    return LoadedModel(model_id="random:tiny", path=path, head=load_head(path), weights_sha256="0" * 64)


def new_call(model: LoadedModel, **request) -> Call:
    request.setdefault("messages", MESSAGES)
    call = Call(request=ChatRequest(params=ChatParams(verify="sampled"), **request), model=model,
                client=SimpleNamespace(tokens_sent=0))
    call.prompt_ids = model.head.encode_chat([m.for_template() for m in call.request.messages])
    return call


def step(call: Call, logits_generator: torch.Generator) -> None:
    call.before_sampling()
    logits = torch.randn(call.model.head.info.vocab_size, generator=logits_generator) * 4
    token = call.shaping.next_token(logits, call.generator)
    sampled = call.accept(token, torch.zeros(1))
    call.client.tokens_sent += 1
    call.finish_reason = sampled.finish_reason


def run(call: Call, seed: int) -> str:
    logits_generator = torch.Generator().manual_seed(seed)
    while call.finish_reason is None:
        step(call, logits_generator)
    return call.text_stream.text


def assert_valid(answer: dict) -> None:
    assert set(answer) == {"name", "count", "ok", "tags"}
    assert isinstance(answer["name"], str) and len(answer["name"]) <= 12
    assert isinstance(answer["count"], int) and isinstance(answer["ok"], bool)
    assert len(answer["tags"]) <= 3 and set(answer["tags"]) <= {"a", "b"}


def test_json_schema_answers_validate_from_logits_that_know_nothing(model):
    for seed in range(20):
        call = new_call(model, temperature=1.0, seed=seed, max_tokens=400,
                        response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": True}})
        text = run(call, seed)
        assert call.finish_reason == "stop"
        assert_valid(json.loads(text))


def test_json_object_ends_at_its_closing_brace_and_max_tokens_cuts_json_as_length(model):
    whole = new_call(model, max_tokens=400, response_format={"type": "json_object"})
    assert isinstance(json.loads(run(whole, 1)), dict) and whole.finish_reason == "stop"
    cut = new_call(model, max_tokens=3, response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    text = run(cut, 1)
    assert cut.finish_reason == "length" and len(cut.generated) == 3
    with pytest.raises(ValueError):
        json.loads(text)


def test_a_call_that_goes_back_rolls_its_matcher_back_and_draws_the_same_valid_answer(model):
    asked = dict(temperature=1.0, seed=3, max_tokens=400,
                 response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    reference = run(new_call(model, **asked), 5)
    call = new_call(model, **asked)
    logits_generator = torch.Generator().manual_seed(5)
    states = []
    for _ in range(8):
        states.append(logits_generator.get_state())
        step(call, logits_generator)
    call.rewind(2)
    logits_generator.set_state(states[2])
    while call.finish_reason is None:
        step(call, logits_generator)
    assert call.text_stream.text == reference
    call.rewind(0)
    allowed = torch.isfinite(call.grammar.mask(torch.zeros(model.head.info.vocab_size)))
    assert [model.head.token_text(token) for token in allowed.nonzero().flatten().tolist()] == ["{"]


def test_a_required_tool_call_names_a_tool_and_its_arguments_follow_that_tools_schema(model):
    for seed in range(6):
        call = new_call(model, temperature=1.0, seed=seed, max_tokens=400, tools=[WEATHER, CLOCK],
                        tool_choice="required")
        made = json.loads(run(call, seed))
        assert call.finish_reason == "tool_calls"
        assert made["name"] in {"get_weather", "get_time"}
        if made["name"] == "get_weather":
            assert made["arguments"]["city"] in {"Paris", "Oslo"} and isinstance(made["arguments"]["days"], int)
        else:
            assert made["arguments"] == {}
    named = new_call(model, max_tokens=400, tools=[WEATHER, CLOCK],
                     tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert json.loads(run(named, 0)) == {"name": "get_time", "arguments": {}}


def test_auto_allows_text_that_opens_no_call(model):
    word = model.head.encode_prompt("t5")[0]
    call = new_call(model, max_tokens=4, tools=[WEATHER], tool_choice="auto", logit_bias={word: 100})
    assert run(call, 0).split() == ["t5"] * 4 and call.finish_reason == "length"
    opened = new_call(model, max_tokens=400, tools=[WEATHER],
                      logit_bias={model.head.encode_prompt("{")[0]: 100})
    assert json.loads(run(opened, 0))["name"] == "get_weather" and opened.finish_reason == "tool_calls"


def test_masked_logits_are_sampled_among_the_allowed_tokens_only():
    logits = torch.full((10,), float("-inf"))
    logits[[2, 7]] = torch.tensor([0.0, 0.1])
    generator = torch.Generator().manual_seed(0)
    drawn = {sample_token(logits, SamplingParams(temperature=1.0), generator) for _ in range(64)}
    assert drawn == {2, 7}


def test_schemas_the_library_cannot_compile_are_refused_naming_the_field(model):
    bad = ChatRequest(messages=MESSAGES, response_format={"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}, "required": ["x"]}}})
    with pytest.raises(BadRequest, match="response_format.json_schema.schema"):
        output_grammar(bad).check(model)


def test_the_random_models_template_renders_tools_and_the_calls_of_the_history(model):
    history = [m.for_template() for m in ChatRequest(messages=[
        {"role": "user", "content": "t1"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "t9"}]).messages]
    text = model.head.tokenizer.apply_chat_template(history, tools=[WEATHER], add_generation_prompt=True,
                                                    tokenize=False)
    assert '"name": "get_weather"' in text and '{"name": "get_time", "arguments": {}}' in text
    assert text.count("<|im_start|>") == 5 and text.endswith("<|im_start|>assistant\n")
    start = model.head.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert model.head.encode_chat(history, tools=[WEATHER]).count(start) == 5


def test_the_mask_allows_exactly_the_tokens_the_grammar_allows(model):
    # hearth unpacks llguidance's bitmask itself (hearth/inference/grammar.py says why): it must agree with the
    # library's own numpy kernel, bit for bit, at every step of a constrained answer.
    import llguidance.numpy
    import numpy as np

    from hearth.inference.grammar import GrammarState, json_schema_grammar
    from hearth.services.orchestrator.constrained import _table

    vocab = model.head.info.vocab_size
    generated: list[int] = []
    state = GrammarState(_table(model), json_schema_grammar(SCHEMA), generated)
    scores_generator = torch.Generator().manual_seed(3)
    for _ in range(12):
        scores = torch.randn(vocab, generator=scores_generator)
        masked = state.mask(scores)
        expected = scores.numpy().copy()[None, :]
        llguidance.numpy.apply_token_bitmask_inplace(expected, state._bitmask)
        assert np.array_equal(masked.numpy(), expected[0])
        assert 0 < int(torch.isfinite(masked).sum()) < vocab
        generated.append(int(torch.argmax(masked)))
        if state.stopped:
            break
