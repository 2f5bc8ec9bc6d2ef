"""logprobs, logit_bias and penalties through a real mesh (nats-server, three shard hosts of the tiny model, an
orchestrator, `hearth gateway`) read by the `openai` client: a greedy call that asks for logprobs answers the same
text as one that does not, its log-probabilities match a local forward of the whole model within 1e-4 (streamed
and not, chat and completions), and a logit bias steers what the mesh samples."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from hearth.inference import load_head
from hearth.inference.logit_shaping import LogitShaping
from hearth.inference.sampling import SamplingParams
from hearth.services.gateway.keys import create_api_key
from tests.e2e.conftest import TINY_MODEL_NAME, three_shard_mesh

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
PROMPT = "the quick brown fox"
MAX_TOKENS = 8
TOP = 3
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def client(tmp_path_factory, tiny_models_dir):
    with three_shard_mesh(tmp_path_factory.mktemp("logprobs"), tiny_models_dir) as cluster:
        key = create_api_key(cluster.member_key("alice", "client").parents[1], "alice")
        gateway = cluster.start_gateway()
        yield openai.OpenAI(base_url=f"{gateway.ready_file.read_text()}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    """Greedy tokens and every step's log-softmax of the whole model run locally by transformers."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    head = load_head(tiny_model_path)

    def greedy(prompt_ids: list[int]) -> tuple[list[int], list[torch.Tensor]]:
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        return (out.sequences[0, len(prompt_ids):].tolist(),
                [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits])

    return head, greedy


def assert_matches(reference, prompt_ids, entries, *, keyed_by_text: bool = False) -> None:
    """`entries`: (token text, logprob, [(text, logprob)] best first) per generated token; `keyed_by_text`: the
    alternatives came as completions' dict, where tokens that decode alike share one key (the most likely's)."""
    head, greedy = reference
    tokens, logprobs = greedy(prompt_ids)
    assert [text for text, _, _ in entries] == [head.token_text(token) for token in tokens]
    for (_, logprob, top), token, expected in zip(entries, tokens, logprobs):
        assert abs(logprob - float(expected[token])) <= LOGPROB_TOLERANCE
        best = torch.topk(expected, TOP)
        expected_top = [(head.token_text(t), value) for t, value in zip(best.indices.tolist(), best.values.tolist())]
        if keyed_by_text:
            expected_top = list({text: value for text, value in reversed(expected_top)}.items())[::-1]
        assert [text for text, _ in top] == [text for text, _ in expected_top]
        assert max(abs(got - want) for (_, got), (_, want) in zip(top, expected_top)) <= LOGPROB_TOLERANCE


def test_chat_logprobs_match_a_local_forward_and_leave_the_text_unchanged(client, reference):
    messages = [{"role": "user", "content": PROMPT}]
    asked = dict(model=TINY_MODEL_NAME, messages=messages, temperature=0, max_tokens=MAX_TOKENS)
    plain = client.chat.completions.create(**asked)
    answer = client.chat.completions.create(**asked, logprobs=True, top_logprobs=TOP)
    assert answer.choices[0].message.content == plain.choices[0].message.content
    assert plain.choices[0].logprobs is None
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == MAX_TOKENS
    assert all(bytes(entry.bytes) == entry.token.encode() for entry in content)
    prompt_ids = reference[0].encode_chat(messages)
    assert_matches(reference, prompt_ids, [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
                                           for e in content])

    chunks = list(client.chat.completions.create(**asked, logprobs=True, top_logprobs=TOP, stream=True))
    streamed = [entry for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content


def test_completion_logprobs_match_a_local_forward_streamed_too(client, reference):
    asked = dict(model=TINY_MODEL_NAME, prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS)
    plain = client.completions.create(**asked)
    answer = client.completions.create(**asked, logprobs=TOP)
    assert answer.choices[0].text == plain.choices[0].text
    logprobs = answer.choices[0].logprobs
    entries = [(token, logprob, sorted(top.items(), key=lambda item: -item[1]))
               for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs)]
    assert_matches(reference, reference[0].encode_prompt(PROMPT), entries, keyed_by_text=True)
    assert logprobs.text_offset == [sum(len(token) for token in logprobs.tokens[:i]) for i in range(MAX_TOKENS)]

    chunks = list(client.completions.create(**asked, logprobs=TOP, stream=True))
    streamed = [chunk.choices[0].logprobs for chunk in chunks if chunk.choices and chunk.choices[0].logprobs]
    assert [token for chunk in streamed for token in chunk.tokens] == logprobs.tokens
    assert [offset for chunk in streamed for offset in chunk.text_offset] == logprobs.text_offset


def test_bias_and_penalties_sample_on_the_mesh_as_they_do_locally(client, reference, tiny_model_path):
    head, greedy = reference
    prompt_ids = head.encode_prompt(PROMPT)
    unbiased, _ = greedy(prompt_ids)
    forced = next(token for token in range(3, head.info.vocab_size)
                  if token not in unbiased and head.token_text(token).isalpha())
    answer = client.completions.create(model=TINY_MODEL_NAME, prompt=PROMPT, temperature=0, max_tokens=4,
                                       logit_bias={str(forced): 100}, logprobs=0)
    assert answer.choices[0].logprobs.tokens == [head.token_text(forced)] * 4

    # The unbiased call's second choice at its first step, lifted well past the first even once penalised.
    runner_up = int(torch.topk(greedy(prompt_ids)[1][0], 2).indices[1])
    options = dict(logit_bias={runner_up: 10.0}, presence_penalty=0.5, frequency_penalty=1.5, repetition_penalty=1.3)
    shaped = client.completions.create(
        model=TINY_MODEL_NAME, prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS, logprobs=0,
        logit_bias={str(runner_up): 10.0}, presence_penalty=0.5, frequency_penalty=1.5,
        extra_body={"repetition_penalty": 1.3}).choices[0]  # an extension: not among the client's arguments
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    generated: list[int] = []
    shaping = LogitShaping(SamplingParams(logprobs=True, **options), prompt_ids, generated)
    expected_logprobs = []
    with torch.inference_mode():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([prompt_ids + generated])).logits[0, -1].float()
            generated.append(shaping.next_token(logits))
            expected_logprobs.append(shaping.last.logprob)
    assert shaped.logprobs.tokens == [head.token_text(token) for token in generated]
    assert generated[0] == runner_up != unbiased[0]  # the options changed what was sampled
    assert max(abs(got - want) for got, want in zip(shaped.logprobs.token_logprobs, expected_logprobs)) \
        <= LOGPROB_TOLERANCE
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        client.completions.create(model=TINY_MODEL_NAME, prompt=PROMPT, max_tokens=2, frequency_penalty=3)
