"""A conversation's kept history meeting failures, over real processes: the host keeping it killed between two turns or
in the middle of one, and its blocks evicted for another conversation's session under a small KV budget; every turn
still answers with generate()'s greedy tokens for the whole history (no reuse), and reuse comes back on the chain
that answered."""

from __future__ import annotations

import asyncio
import signal

import pytest

from hearth.events.streams import PIPELINES_STREAM
from hearth.protocol.chat import ChatMessage, ChatRequest
from hearth.services.broker.connection import connect_nats
from hearth.services.devtools.local_cluster import LocalCluster
from tests.e2e.conftest import TINY_MODEL_NAME, start_orchestrator
from tests.e2e.event_log_support import wait_for_event
from tests.e2e.failover_support import failover_env, stream_with_action
from tests.unit.inference_tiny_models import TINY_EOS_TOKEN_ID
from tests.e2e.test_conversations_e2e import BLOCK, FIRST, SECOND, THIRD, reference_ids, template_ids

pytestmark = pytest.mark.e2e

ANSWER_TOKENS = 16
# Tiny llama, 2 layers per shard: 512 bytes of KV per position. Room for one conversation's session or its kept
# blocks, not for both.
KV_BUDGET_MB = 256 * 512 / 2**20


def start_mesh(cluster: LocalCluster, models_dir, middle_hosts: int = 3, middle_env: dict[str, str] | None = None):
    """Hosts of layers 0-1 and 4-5, `middle_hosts` of layers 2-3 (with `middle_env`), an orchestrator naming blocks of
    BLOCK tokens."""
    model = str(models_dir / TINY_MODEL_NAME)
    cluster.extra_env.update(failover_env())
    cluster.start_shard(model, 0, 1, node_id="first", wait_ready=False)
    cluster.extra_env.update(middle_env or {})
    for index in range(middle_hosts):
        cluster.start_shard(model, 2, 3, node_id=f"middle{index}", wait_ready=False)
    for key in middle_env or {}:
        cluster.extra_env.pop(key)
    cluster.start_shard(model, 4, 5, node_id="last", wait_ready=False)
    start_orchestrator(cluster, models_dir, env={"HEARTH_PREFIX_CACHE__BLOCK_TOKENS": str(BLOCK)})
    cluster.wait_all_ready()


class Conversation:
    """One conversation's messages on a client connection; each turn checked against generate()."""

    def __init__(self, cluster: LocalCluster, models_dir, nc, first_message: str) -> None:
        self.cluster, self.path, self.nc = cluster, models_dir / TINY_MODEL_NAME, nc
        self.messages = [{"role": "user", "content": first_message}]

    def request(self) -> ChatRequest:
        return ChatRequest(model=TINY_MODEL_NAME, max_tokens=ANSWER_TOKENS,
                           messages=[ChatMessage(**message) for message in self.messages])

    async def turn(self, next_message: str | None = None, action=None, after_tokens: int = 3):
        """The next turn (`action` run after `after_tokens` tokens): the call, and the prompt positions it reused."""
        if next_message is not None:
            self.messages.append({"role": "user", "content": next_message})
        call = await stream_with_action(self.nc, self.request(), action, after_tokens=after_tokens)
        assert call.final.type == "done", call.final
        prompt_ids = tuple(template_ids(self.path, self.messages))
        expected = await asyncio.to_thread(reference_ids, self.path, prompt_ids, ANSWER_TOKENS)
        # An answer that ends with the end-of-text token has it in generate()'s ids, not among its text's tokens.
        assert call.answer_token_ids == expected[:-1] if expected[-1:] == [TINY_EOS_TOKEN_ID] else expected
        self.messages.append({"role": "assistant", "content": "".join(f.text for f in call.of_type("token_delta"))})
        pipeline_id = call.pipeline_id
        constructed = await wait_for_event(self.nc, PIPELINES_STREAM, lambda item: item.event.type ==
                                           "pipeline.constructed" and item.event.pipeline_id == pipeline_id)
        return call, constructed.event.cached_prompt_tokens


def middle_host(cluster: LocalCluster, shard_id: str):
    node = shard_id.rpartition("@")[2]
    return next(process for process in cluster.processes if process.name.startswith(f"shard-{node}-"))


async def connect(cluster: LocalCluster):
    return await connect_nats(cluster.nats_url, name="e2e-client", settings=cluster.nats_settings())


async def test_the_host_keeping_a_conversation_killed_between_turns_or_mid_turn(cluster, tiny_models_dir):
    start_mesh(cluster, tiny_models_dir)
    nc = await connect(cluster)
    try:
        conversation = Conversation(cluster, tiny_models_dir, nc, FIRST)
        first, _ = await conversation.turn()
        keeper = first.first_hops[1]
        # Killed between turns: the next turn routes around it, prefills, and answers as a whole prefill does.
        middle_host(cluster, keeper).signal(signal.SIGKILL)
        second, _ = await conversation.turn(SECOND)
        assert keeper not in second.first_hops
        # Killed mid-turn (a turn that began from kept blocks): failed over, the same greedy tokens.
        victim = second.first_hops[1]
        third, cached = await conversation.turn(THIRD, lambda: middle_host(cluster, victim).signal(signal.SIGKILL))
        assert cached > 0 and victim in third.first_hops
        assert [f.failed_shard_id for f in third.of_type("shard_failover")] == [victim]
        # The chain that answered after the failover keeps the history: the next turn reuses it.
        _, cached = await conversation.turn("and the one after that")
        assert cached > 0
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)


async def test_a_conversation_whose_kept_history_was_evicted_for_another_s_session(cluster, tiny_models_dir):
    start_mesh(cluster, tiny_models_dir, middle_hosts=1,
               middle_env={"HEARTH_SHARD__KV_CACHE_BUDGET_MB": repr(KV_BUDGET_MB)})
    nc = await connect(cluster)
    try:
        ours = Conversation(cluster, tiny_models_dir, nc, FIRST)
        await ours.turn()
        theirs = Conversation(cluster, tiny_models_dir, nc, "a conversation about gardens, their seasons and their "
                                                            "households, long enough to need the whole budget")
        await theirs.turn()
        await theirs.turn(SECOND)
        # Ours was given way to: prefilled again (what the middle host no longer holds), the same greedy tokens.
        _, cached = await ours.turn(SECOND)
        assert cached == 0
        # Whatever the budget let it keep of that turn (its answer's warm-up competes for the same room).
        await ours.turn(THIRD)
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)
