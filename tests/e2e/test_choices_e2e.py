"""`n` > 1 through a real mesh (nats-server, three shard hosts of the tiny model, an orchestrator, `hearth gateway`)
read by the `openai` client and the Node client: a sampled call with a seed answers `n` non-empty choices, the same
ones again for the same request, streamed or not; greedy choices are each the answer of a call asking for one."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from hearth.services.gateway.keys import create_api_key
from tests.e2e.conftest import TINY_MODEL_NAME, three_shard_mesh
from tests.e2e.test_node_client import node_client, run_node  # noqa: F401 (node_client: a fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
PROMPT = "the quick brown fox"
MAX_TOKENS = 8
SAMPLED = dict(model=TINY_MODEL_NAME, max_tokens=MAX_TOKENS, n=3, temperature=0.9, seed=7)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    with three_shard_mesh(tmp_path_factory.mktemp("choices"), tiny_models_dir) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(mesh):
    key = create_api_key(mesh.member_key("alice", "client").parents[1], "alice")
    gateway = mesh.start_gateway()
    return openai.OpenAI(base_url=f"{gateway.ready_file.read_text()}/v1", api_key=key, max_retries=0)


def streamed_texts(chunks, n: int) -> tuple[list[str], list[str | None]]:
    """Each choice's text and finish reason from a stream's chunks."""
    texts, reasons = [""] * n, [None] * n
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text  # chat or completions
            texts[choice.index] += piece or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    return texts, reasons


def test_sampled_choices_with_a_seed_are_non_empty_and_the_same_for_the_same_request(client):
    messages = [{"role": "user", "content": PROMPT}]
    first = client.chat.completions.create(messages=messages, **SAMPLED)
    texts = [choice.message.content for choice in first.choices]
    assert [choice.index for choice in first.choices] == [0, 1, 2] and all(texts), texts
    assert all(choice.finish_reason in ("stop", "length") for choice in first.choices)
    assert len(set(texts)) > 1  # choice i draws with seed + i
    again = client.chat.completions.create(messages=messages, **SAMPLED)
    assert [choice.message.content for choice in again.choices] == texts
    assert again.usage.completion_tokens == first.usage.completion_tokens
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **SAMPLED))
    assert streamed_texts(chunks, 3) == (texts, [choice.finish_reason for choice in first.choices])

    completion = client.completions.create(prompt=PROMPT, **SAMPLED)
    completion_texts = [choice.text for choice in completion.choices]
    assert all(completion_texts) and len(completion_texts) == 3
    streamed, _ = streamed_texts(client.completions.create(prompt=PROMPT, stream=True, **SAMPLED), 3)
    assert streamed == completion_texts


def test_greedy_choices_are_each_the_answer_of_one_choice(client):
    greedy = dict(model=TINY_MODEL_NAME, max_tokens=MAX_TOKENS, temperature=0)
    one = client.completions.create(prompt=PROMPT, **greedy)
    pair = client.completions.create(prompt=PROMPT, n=2, **greedy)
    assert [choice.text for choice in pair.choices] == [one.choices[0].text] * 2
    assert pair.usage.completion_tokens == 2 * one.usage.completion_tokens


async def test_the_node_client_reads_each_choice(node_client, mesh):  # noqa: F811 (the imported fixture)
    args = ("--max-tokens", str(MAX_TOKENS))
    one = await asyncio.to_thread(run_node, node_client, mesh, *args, PROMPT)
    pair = await asyncio.to_thread(run_node, node_client, mesh, *args, "--n", "2", PROMPT)
    assert one.returncode == pair.returncode == 0, f"{one.stderr}\n{pair.stderr}"
    single, double = (json.loads(run.stdout.strip().splitlines()[-1]) for run in (one, pair))
    assert double["text"] == single["text"] and double["choice_texts"] == [single["text"]] * 2
    assert [end["choice"] for end in double["choices"]] == [0, 1]
