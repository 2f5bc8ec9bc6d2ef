"""Logit bias, penalties and log-probabilities at the head (hearth/inference/logit_shaping.py): each option changes the
logits as its definition says (OpenAI's bias and presence/frequency penalties, transformers' repetition penalty), in
vLLM's order; the reported log-probabilities equal `generate()`'s log-softmax; a call that asks for none of them takes
the plain path; and batched head steps give such rows exactly their solo tokens and log-probabilities."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hearth.inference import load_full, load_head
from hearth.inference.head_batch import HeadRow, batched_next_tokens, solo_next_token
from hearth.inference.logit_shaping import LogitShaping
from hearth.inference.sampling import SamplingParams, sample_token
from hearth.protocol.chat import ChatRequest
from hearth.services.orchestrator.call import Call
from tests.runner_limits import RUNNER_KV_LIMITS

from .inference_tiny_models import one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)

LOGPROB_TOLERANCE = 1e-4
LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 0.0])


def shaped(params: SamplingParams, prompt=(), generated=()) -> torch.Tensor:
    return LogitShaping(params, list(prompt), list(generated)).shape(LOGITS)


def test_plain_params_shape_nothing_and_any_option_does():
    assert SamplingParams().plain and SamplingParams(temperature=0.7, top_k=3, seed=1).plain
    for option in (dict(presence_penalty=0.1), dict(frequency_penalty=-0.1), dict(repetition_penalty=1.2),
                   dict(logit_bias={3: 1.0})):
        params = SamplingParams(**option)
        assert params.shapes_logits and not params.plain
    assert not SamplingParams(logprobs=True).shapes_logits and not SamplingParams(logprobs=True).plain


def test_logit_bias_is_added_to_its_tokens_and_ids_beyond_the_vocabulary_are_ignored():
    expected = LOGITS.clone()
    expected[1] += 5.0
    expected[3] -= 100.0
    assert torch.equal(shaped(SamplingParams(logit_bias={1: 5.0, 3: -100.0, 99: 7.0})), expected)


def test_presence_and_frequency_penalties_follow_openai_s_formula_over_generated_tokens_only():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    got = shaped(params, prompt=[4, 4], generated=[0, 3, 3, 3])
    counts = torch.tensor([1.0, 0, 0, 3, 0, 0])
    assert torch.allclose(got, LOGITS - counts * 0.25 - (counts > 0).float() * 0.5)
    assert torch.equal(shaped(params, prompt=[0, 1]), LOGITS)  # nothing generated yet: nothing to penalise


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_generated_tokens():
    got = shaped(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], generated=[1, 4])
    expected = LOGITS.clone()
    expected[0], expected[1], expected[4] = 2.0 / 2, -1.0 * 2, -2.0 * 2
    assert torch.equal(got, expected)


def test_bias_comes_before_the_penalties():
    params = SamplingParams(logit_bias={1: 3.0}, repetition_penalty=2.0, presence_penalty=0.5)
    got = shaped(params, generated=[1])
    assert float(got[1]) == pytest.approx((-1.0 + 3.0) / 2.0 - 0.5)


def test_a_biased_greedy_call_picks_the_forced_token_and_a_banned_best_token_is_never_picked():
    forced = LogitShaping(SamplingParams(logit_bias={4: 100.0}), [], [])
    assert forced.next_token(LOGITS) == 4
    banned = LogitShaping(SamplingParams(logit_bias={3: -100.0}, temperature=1.0, seed=7), [], [])
    generator = banned.params.make_generator()
    assert 3 not in {banned.next_token(LOGITS, generator) for _ in range(200)}


def test_logprobs_are_the_log_softmax_before_temperature_with_the_best_alternatives_first():
    params = SamplingParams(temperature=0.3, seed=1, logprobs=True, top_logprobs=3)
    shaping = LogitShaping(params, [], [])
    token_id = shaping.next_token(LOGITS, params.make_generator())
    expected = torch.log_softmax(LOGITS, dim=-1)
    assert shaping.last.token_id == token_id
    assert shaping.last.logprob == pytest.approx(float(expected[token_id]))
    assert [token for token, _ in shaping.last.top] == [3, 0, 2]
    assert [logprob for _, logprob in shaping.last.top] == pytest.approx(expected[[3, 0, 2]].tolist())
    # Sampling is untouched by asking for logprobs: the same seed draws the same token.
    assert token_id == sample_token(LOGITS, params, params.make_generator())


def test_logprobs_equal_generate_s_log_softmax(tiny_model_dir):
    path = tiny_model_dir("llama")
    local = load_full(path, **RUNNER_KV_LIMITS)
    prompt = local.head.encode_prompt("the quick brown fox")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generated = reference.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    expected_tokens = generated.sequences[0, len(prompt):].tolist()
    params = SamplingParams(logprobs=True, top_logprobs=5, max_tokens=6)
    tokens: list[int] = []
    shaping = LogitShaping(params, prompt, tokens)
    hidden = local.runner.forward("s", local.head.embed(prompt), 0, "prefill")
    for step, step_logits in enumerate(generated.logits):
        tokens.append(shaping.next_token(local.head.logits(hidden)))
        expected = torch.log_softmax(step_logits[0].float(), dim=-1)
        assert abs(shaping.last.logprob - float(expected[tokens[-1]])) <= LOGPROB_TOLERANCE
        top = torch.topk(expected, 5)
        assert [token for token, _ in shaping.last.top] == top.indices.tolist()
        assert max(abs(got - want) for (_, got), want in zip(shaping.last.top, top.values.tolist())) \
            <= LOGPROB_TOLERANCE
        hidden = local.runner.forward("s", local.head.embed([tokens[-1]]), len(prompt) + step, "decode")
    assert tokens == expected_tokens  # greedy output is unchanged by asking for logprobs


def test_shaped_rows_in_a_batch_get_exactly_their_solo_tokens_and_logprobs(tiny_model_dir):
    head = load_head(tiny_model_dir("llama"))
    states = [torch.randn(1, 2, head.info.hidden_size, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    options = [dict(logprobs=True, top_logprobs=2), dict(repetition_penalty=1.5, logprobs=True),
               dict(logit_bias={5: 50.0}), dict()]

    def rows() -> list[HeadRow]:
        made = []
        for hidden, option in zip(states, options):
            params = SamplingParams(**option)
            made.append(HeadRow(hidden, params, None, None if params.plain else LogitShaping(params, [5, 6], [7])))
        return made

    solo_rows, batch_rows = rows(), rows()
    solo = [solo_next_token(head, row) for row in solo_rows]
    assert batched_next_tokens(head, batch_rows) == solo
    assert solo[2] == 5
    for alone, batched in zip(solo_rows, batch_rows):
        if alone.shaping is not None:
            assert alone.shaping.last == batched.shaping.last


def test_a_call_asking_for_none_of_the_options_has_no_shaping():
    plain = Call(request=ChatRequest(prompt="x", temperature=0.5, seed=3), model=None, client=None)
    assert plain.shaping is None
    asked = Call(request=ChatRequest(prompt="x", logprobs=True, top_logprobs=2, frequency_penalty=0.5,
                                     logit_bias={"7": -3}), model=None, client=None, prompt_ids=[1, 2])
    assert asked.params.logit_bias == ((7, -3.0),) and asked.params.top_logprobs == 2
    assert asked.shaping is not None and asked.shaping.params is asked.params
