"""Conversations as users hold them, over real processes: the OpenAI client through the gateway sending its growing
message list, and `hearth chat -i`; every turn's greedy answer is what transformers' generate() gives for the whole
history (no reuse), while later turns begin from the blocks the earlier ones kept; an edited history (an earlier
message, the assistant's answer replaced, a system prompt added), another member's identical history and an answer
cut by a stop string reuse only what still matches."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from functools import lru_cache

import openai
import pytest
from transformers import AutoTokenizer

from hearth.events.streams import PIPELINES_STREAM
from hearth.services.broker.connection import connect_nats
from hearth.services.gateway.keys import create_api_key
from tests.e2e.conftest import THREE_SHARD_RANGES, TINY_MODEL_NAME, start_orchestrator
from tests.e2e.event_log_support import read_events, wait_for_event
from hearth.services.devtools.local_cluster import LocalCluster

pytestmark = pytest.mark.e2e

BLOCK = 8
PUBLIC_SYSTEM_PROMPT = "you are the helpful assistant of a community mesh of households and their machines"
ANSWER_TOKENS = 20
CHAT_WAIT_S = 120


class Conversations:
    """The module's mesh: three hosts, an orchestrator naming blocks of BLOCK tokens, a gateway with API keys of two
    members."""

    def __init__(self, cluster: LocalCluster, models_dir, url: str, keys: dict[str, str]) -> None:
        self.cluster, self.models_dir, self.url, self.keys = cluster, models_dir, url, keys
        self.path = models_dir / TINY_MODEL_NAME
        self.ran: dict[str, list[list[int]]] = {}  # per member: the positions each of its calls ran

    def client(self, member: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.keys[member], max_retries=0,
                                  timeout=CHAT_WAIT_S)

    async def cached_of(self, request_id: str) -> int:
        """`cached_prompt_tokens` of the call's `pipeline.constructed`."""
        nc = await connect_nats(self.cluster.nats_url, name="e2e-events", settings=self.cluster.nats_settings())
        try:
            found = await wait_for_event(nc, PIPELINES_STREAM, lambda item: item.event.type == "pipeline.constructed"
                                         and item.event.request_id == request_id)
            return found.event.cached_prompt_tokens
        finally:
            await asyncio.wait_for(nc.close(), timeout=5)

    async def turn(self, member: str, messages: list[dict], **options) -> tuple[str, int, list[int]]:
        """One call through the gateway (`options`: the OpenAI client's): its text (checked against generate()'s for
        the whole history), the prompt positions its hops held already (checked to be whole blocks of what this
        member's calls ran before, or of a public system prompt's `public` positions) and its prompt's ids."""
        max_tokens = options.pop("max_tokens", ANSWER_TOKENS)
        public = options.pop("public", 0)  # positions of a public system prompt any member's calls may have kept
        answer = await self.client(member).chat.completions.create(
            model=TINY_MODEL_NAME, messages=messages, temperature=0, max_tokens=max_tokens, **options)
        prompt_ids = template_ids(self.path, messages)
        expected = await asyncio.to_thread(reference_ids, self.path, tuple(prompt_ids), max_tokens)
        text = answer.choices[0].message.content
        assert text == decoded(self.path, expected), (text, decoded(self.path, expected))
        cached = await self.cached_of(answer.id.removeprefix("chatcmpl-"))
        shared = max([public, *(common(ran, prompt_ids[:-1]) for ran in self.ran.get(member, []))])
        assert cached % BLOCK == 0 and cached <= shared, (cached, shared)
        self.ran.setdefault(member, []).append(prompt_ids + expected[:-1])
        return text, cached, prompt_ids


@lru_cache(maxsize=4)
def tokenizer_of(path):
    return AutoTokenizer.from_pretrained(path)


def template_ids(path, messages: list[dict]) -> list[int]:
    return list(tokenizer_of(path).apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=True)["input_ids"])


@lru_cache(maxsize=64)
def reference_ids(path, prompt_ids: tuple[int, ...], new_tokens: int) -> list[int]:
    """transformers' greedy generate() of the whole prompt (float32): what a call that reuses nothing gives."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        output = model.generate(torch.tensor([list(prompt_ids)]), max_new_tokens=new_tokens, do_sample=False,
                                pad_token_id=0)
    return output[0, len(prompt_ids):].tolist()


def decoded(path, ids: list[int]) -> str:
    """The text of `ids` as hearth streams it: an answer ending inside a character leaves that character out."""
    return tokenizer_of(path).decode(ids, skip_special_tokens=True).rstrip("\ufffd")


def common(ours: list[int], theirs: list[int]) -> int:
    """Whole blocks (as positions) of the longest beginning two id sequences share."""
    length = 0
    for a, b in zip(ours, theirs):
        if a != b:
            break
        length += 1
    return length // BLOCK * BLOCK


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    work_dir = tmp_path_factory.mktemp("conversations")
    with LocalCluster(work_dir=work_dir, torch_threads=1) as cluster:
        cluster.start_nats()
        for index, (lo, hi) in enumerate(THREE_SHARD_RANGES):
            cluster.start_shard(str(tiny_models_dir / TINY_MODEL_NAME), lo, hi, node_id=f"host{index}",
                                wait_ready=False)
        start_orchestrator(cluster, tiny_models_dir, env={"HEARTH_PREFIX_CACHE__BLOCK_TOKENS": str(BLOCK),
                                                          "HEARTH_PREFIX_CACHE__PUBLIC_SYSTEM_PROMPTS":
                                                          json.dumps([PUBLIC_SYSTEM_PROMPT])})
        cluster.wait_all_ready()
        keys = {name: create_api_key(cluster.member_key(name, "client").parents[1], name)
                for name in ("alice", "dora")}
        gateway = cluster.start_gateway()
        try:
            yield Conversations(cluster, tiny_models_dir, gateway.ready_file.read_text(), keys)
        finally:
            for process in cluster.processes:
                print(f"----- {process.name} -----\n{process.log_tail(3000)}")


FIRST = "tell me how a community of households shares one model across its machines"
SECOND = "and what happens when one of the houses goes offline in the middle of an answer"
THIRD = "then how does the next house know what the last one computed"


async def test_an_openai_client_s_growing_conversation_reuses_its_history_and_answers_as_a_whole_prefill(mesh):
    messages = [{"role": "user", "content": FIRST}]
    first, cached, _ = await mesh.turn("alice", messages)
    assert cached == 0
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": SECOND}]
    second, cached, prompt_ids = await mesh.turn("alice", messages)
    assert cached >= len(template_ids(mesh.path, messages[:1])) // BLOCK * BLOCK, cached
    messages += [{"role": "assistant", "content": second}, {"role": "user", "content": THIRD}]
    _, cached, _ = await mesh.turn("alice", messages)
    assert cached >= len(prompt_ids) // BLOCK * BLOCK - BLOCK, cached

    # Another member sending the very same history finds none of alice's blocks.
    _, cached, _ = await mesh.turn("dora", messages)
    assert cached == 0
    # An earlier message changed: only the blocks before the change may be reused.
    edited = [dict(messages[0], content="tell me how a family shares one model across its machines"), *messages[1:]]
    await mesh.turn("alice", edited)
    # The assistant's answer replaced by the client.
    replaced = [messages[0], dict(messages[1], content="they pass activations along"), *messages[2:]]
    await mesh.turn("alice", replaced)
    # A system prompt put in front: nothing kept begins that way.
    _, cached, _ = await mesh.turn("alice", [{"role": "system", "content": "answer briefly"}, *messages])
    assert cached == 0


async def test_an_answer_cut_by_a_stop_string_or_max_tokens_mid_token_then_the_next_turn(mesh):
    messages = [{"role": "user", "content": "what does the last house of a chain do with the output"}]
    full = decoded(mesh.path, reference_ids(mesh.path, tuple(template_ids(mesh.path, messages)), ANSWER_TOKENS))
    # A stop string inside the answer (a few characters from its middle, likely inside one token).
    stop = full[len(full) // 2:len(full) // 2 + 2]
    answer = await mesh.client("alice").chat.completions.create(model=TINY_MODEL_NAME, messages=messages,
                                                                temperature=0, max_tokens=ANSWER_TOKENS, stop=[stop])
    cut = answer.choices[0].message.content
    assert full.startswith(cut) and stop not in cut and answer.choices[0].finish_reason == "stop"
    prompt_ids = template_ids(mesh.path, messages)  # at most these positions ran
    mesh.ran["alice"].append(prompt_ids + reference_ids(mesh.path, tuple(prompt_ids), ANSWER_TOKENS)[:-1])
    messages += [{"role": "assistant", "content": cut}, {"role": "user", "content": SECOND}]
    await mesh.turn("alice", messages)
    # max_tokens ends the answer after a few tokens (a byte-level token may end mid-character).
    short, _, _ = await mesh.turn("alice", messages, max_tokens=3)
    messages += [{"role": "assistant", "content": short}, {"role": "user", "content": THIRD}]
    await mesh.turn("alice", messages)


async def test_hearth_chat_interactive_answers_each_turn_as_a_whole_prefill_and_the_gateway_goes_on_from_it(mesh):
    turns = [FIRST, SECOND, THIRD]
    completed = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "hearth.services.cli", "chat", "-i", turns[0], "--max-tokens", str(ANSWER_TOKENS),
         "--model", TINY_MODEL_NAME], input="\n".join(turns[1:]).encode() + b"\n\n", capture_output=True,
        timeout=CHAT_WAIT_S * 3,
        env={**os.environ, **mesh.cluster.client_env("alice"), "HEARTH_NATS_URL": mesh.cluster.nats_url})
    assert completed.returncode == 0, completed.stderr
    messages, expected = [], ""
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        answer = decoded(mesh.path, reference_ids(mesh.path, tuple(template_ids(mesh.path, messages)),
                                                  ANSWER_TOKENS))
        messages.append({"role": "assistant", "content": answer})
        expected += answer + "\n"
    # Bytes, not text mode: an answer may hold a carriage return, which universal newlines would turn into \\n.
    assert completed.stdout.decode() == expected, (completed.stdout, expected, completed.stderr)
    # Each later turn began from the blocks the turn before kept (the first from those of alice's gateway calls, when
    # the test before asked the same first message).
    nc = await connect_nats(mesh.cluster.nats_url, name="e2e-events", settings=mesh.cluster.nats_settings())
    try:
        constructed = [item.event for item in await read_events(nc, PIPELINES_STREAM)
                       if item.event.type == "pipeline.constructed" and item.event.caller == "alice"]
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)
    cached = [event.cached_prompt_tokens for event in constructed[-3:]]  # alice's calls through the gateway came before
    assert len(cached) == 3 and all(c > 0 for c in cached[1:]), cached
    # The same member goes on through the gateway: the history `hearth chat` kept is its own.
    mesh.ran.setdefault("alice", []).append(template_ids(mesh.path, messages[:-1]) +
                                            reference_ids(mesh.path, tuple(template_ids(mesh.path, messages[:-1])),
                                                          ANSWER_TOKENS)[:-1])
    _, cached, _ = await mesh.turn("alice", [*messages, {"role": "user", "content": "and the gateway?"}])
    assert cached > 0


async def test_a_public_system_prompt_s_blocks_are_shared_by_members_and_an_edited_one_is_not(mesh):
    public = {"role": "system", "content": PUBLIC_SYSTEM_PROMPT}
    public_blocks = common(template_ids(mesh.path, [public]), template_ids(mesh.path, [public, {"role": "user",
                                                                                                "content": "x"}]))
    assert public_blocks > 0
    await mesh.turn("alice", [public, {"role": "user", "content": FIRST}])
    # dora's conversation is her own but for the public prompt's blocks, kept by alice's call on the same hops.
    _, cached, _ = await mesh.turn("dora", [public, {"role": "user", "content": SECOND}], public=public_blocks)
    assert cached == public_blocks
    # A system prompt changed from the public one: only its blocks before the change are the public prompt's tokens.
    edited = [dict(public, content=PUBLIC_SYSTEM_PROMPT.replace("community", "village")),
              {"role": "user", "content": THIRD}]
    still_public = common(template_ids(mesh.path, [public]), template_ids(mesh.path, edited))
    _, cached, _ = await mesh.turn("dora", edited, public=still_public)
    assert still_public < public_blocks and cached == still_public
