"""Prefix affinity across orchestrators over real processes: a conversation's first turn runs through one orchestrator,
its next turn through another of the same member that never saw it (here: the member's orchestrator restarted with a
fresh read model), which finds in its read model (from the first's `pipeline.completed`) the host keeping the
history's blocks and routes there although cost alone picks a replica; the turn begins from kept blocks. An
orchestrator of another member finds no record it could use (the host keeps those blocks for the first member's hops
only) and routes by cost. A client's later turns go back to the orchestrator that answered the first, so they begin
from kept blocks whichever member's orchestrator the queue picked first."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest

from hearth.protocol.chat import ChatRequest
from hearth.services.broker.connection import connect_nats
from hearth.services.client.chat import ChatResult
from hearth.services.client.pinned import stream_chat_pinned
from hearth.services.devtools.local_cluster import LocalCluster
from tests.e2e.conftest import TINY_LAYERS, TINY_MODEL_NAME
from tests.e2e.failover_support import pipeline_events
from tests.e2e.test_prefix_cache_e2e import BLOCK, FIRST_TURN, NEW_TOKENS, ask_constructed

pytestmark = pytest.mark.e2e

ORCHESTRATOR_ENV = {"HEARTH_PREFIX_CACHE__ENABLED": "true", "HEARTH_PREFIX_CACHE__BLOCK_TOKENS": str(BLOCK)}
# How long the second orchestrator's read model may take to replay the log up to the first turn's completion.
READ_MODEL_WAIT_S = 60.0


def start_orchestrator_named(cluster: LocalCluster, models_dir: Path, node_id: str, db: Path):
    cluster.extra_env.update(ORCHESTRATOR_ENV)
    try:
        return cluster.start_orchestrator(node_id=node_id, wait_ready=True, extra_args=[
            "--models-dir", str(models_dir), "--preload", TINY_MODEL_NAME, "--db", str(db)])
    finally:
        for key in ORCHESTRATOR_ENV:
            cluster.extra_env.pop(key)


async def wait_for_kept_record(db: Path) -> None:
    """Until the orchestrator's read model (a file it writes) holds a kept-prefix record."""
    deadline = time.monotonic() + READ_MODEL_WAIT_S
    while time.monotonic() < deadline:
        def count() -> int:
            with sqlite3.connect(db, timeout=5) as connection:
                try:
                    return connection.execute("SELECT COUNT(*) FROM kept_prefixes").fetchone()[0]
                except sqlite3.OperationalError:  # not migrated yet
                    return 0
        if await asyncio.to_thread(count):
            return
        await asyncio.sleep(0.2)
    pytest.fail(f"no kept-prefix record reached {db} within {READ_MODEL_WAIT_S} s")


async def test_a_conversation_s_next_turn_through_another_orchestrator_goes_where_its_history_is_kept(
        cluster, tiny_models_dir, tmp_path):
    model = str(tiny_models_dir / TINY_MODEL_NAME)
    # The host that will keep the history asks to be used last (hop weight 1.5): by cost alone, a replica wins.
    cluster.start_shard(model, 0, TINY_LAYERS - 1, node_id="keeper", extra_args=["--hop-weight", "1.5"])
    first = start_orchestrator_named(cluster, tiny_models_dir, "orchestrator-a", tmp_path / "a.sqlite")
    answer, turn_one = await ask_constructed(cluster, tiny_models_dir, FIRST_TURN)
    assert turn_one.node_id == "orchestrator-a" and turn_one.cached_prompt_tokens == 0
    keeper_id = turn_one.hops[0]
    assert keeper_id.endswith("@keeper")

    cluster.start_shard(model, 0, TINY_LAYERS - 1, node_id="replica")
    replica_id = keeper_id.replace("@keeper", "@replica")
    first.stop()  # the next turn can only reach an orchestrator that never served this conversation
    second_db = tmp_path / "b.sqlite"
    second = start_orchestrator_named(cluster, tiny_models_dir, "orchestrator-a", second_db)
    await wait_for_kept_record(second_db)

    second_turn = FIRST_TURN + answer + " and then the next house answers with what it knows"
    _, turn_two = await ask_constructed(cluster, tiny_models_dir, second_turn)
    assert turn_two.node_id == "orchestrator-a"
    assert turn_two.hops == [keeper_id]
    assert turn_two.cached_prompt_tokens > 0 and turn_two.cached_prompt_tokens % BLOCK == 0
    # Cost alone: a call that begins like nothing kept goes to the replica.
    _, unrelated = await ask_constructed(cluster, tiny_models_dir,
                                         "a different conversation about gardens and their seasons")
    assert unrelated.hops == [replica_id] and unrelated.cached_prompt_tokens == 0

    # Another member's orchestrator: the keeper would attach nothing for its hops, so it goes by cost.
    other_db = tmp_path / "c.sqlite"
    start_orchestrator_named(cluster, tiny_models_dir, "orchestrator-c", other_db)
    second.stop()
    await wait_for_kept_record(other_db)
    _, elsewhere = await ask_constructed(cluster, tiny_models_dir, second_turn)
    assert elsewhere.node_id == "orchestrator-c"
    # Which host it picks is cost's (measured step times, noisy on a loaded machine); the keeper, if picked, attaches
    # nothing of the first member's history to this member's hop.
    assert elsewhere.hops in ([replica_id], [keeper_id]) and elsewhere.cached_prompt_tokens == 0


async def test_a_conversation_s_turns_stay_with_the_orchestrator_whose_member_keeps_its_history(
        cluster, tiny_models_dir):
    """Two members' orchestrators share the queue: a client member's later turns go to the orchestrator the done
    frame named (its own subject, which the broker lets the client publish to and that orchestrator alone hear), so
    each begins from the blocks its member's hops kept."""
    cluster.start_shard(str(tiny_models_dir / TINY_MODEL_NAME), 0, TINY_LAYERS - 1, node_id="keeper", wait_ready=False)
    for name in ("orchestrator-a", "orchestrator-b"):
        start_orchestrator_named(cluster, tiny_models_dir, name, cluster.work_dir / f"{name}.sqlite")
    cluster.wait_all_ready()
    client = await connect_nats(cluster.nats_url, name="e2e-alice",
                                settings=cluster.nats_settings(cluster.member_key("alice", "client")))
    events = await connect_nats(cluster.nats_url, name="e2e-events", settings=cluster.nats_settings())
    try:
        prompt, answered_by, served = FIRST_TURN, None, []
        for turn in range(3):
            result = ChatResult()
            async for frame in stream_chat_pinned(client, ChatRequest(model=TINY_MODEL_NAME, prompt=prompt,
                                                                      max_tokens=NEW_TOKENS),
                                                  orchestrator=answered_by):
                result.frames.append(frame)
            assert result.ok, result.final
            answered_by = result.final.orchestrator
            stored = await pipeline_events(events, result.frames_of("pipeline")[0].pipeline_id)
            constructed = next(item.event for item in stored if item.event.type == "pipeline.constructed")
            assert constructed.node_id == answered_by
            served.append((answered_by, constructed.cached_prompt_tokens))
            prompt += result.text + f" and then turn {turn} asks what the next house knows"
    finally:
        await asyncio.wait_for(client.close(), timeout=5)
        await asyncio.wait_for(events.close(), timeout=5)
    assert len({name for name, _ in served}) == 1, served
    assert all(cached > 0 and cached % BLOCK == 0 for _, cached in served[1:]), served
