"""`hearth host` over real processes: three hosts whose memory budgets are each 40 % of the model's weights choose
their own layers from the mesh's coverage and together serve a model none of them could hold, with generate()'s
greedy output and each host's measured memory within its budget; when a host leaves, one of two hosts holding the
same layers moves to fill the hole; a host killed and restarted at once takes its own layers back; a host killed
for good has its layers taken over once its silence passes the health timeout; a host killed while it moves holds
the others back only until its silence passes the health timeout."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from hearth.events.consume import read_stream
from hearth.events.models import ShardAdvertised, ShardWithdrawn
from hearth.inference import weights_sha256
from hearth.protocol.control import OpenHop
from hearth.protocol.subjects import shard_control_subject
from hearth.events.streams import SHARDS_STREAM
from hearth.services.devtools.local_cluster import LocalCluster
from hearth.services.client.chat import chat
from hearth.protocol.chat import ChatRequest
from hearth.services.broker.connection import connect_nats
from tests.e2e.conftest import TINY_MODEL_NAME, start_orchestrator
from tests.e2e.failover_support import open_hop_as_orchestrator

pytestmark = [pytest.mark.e2e, pytest.mark.scheduled_first]

HOST_ENV = "HEARTH_RESEARCH__DISTRIBUTED_INFERENCE__HOST__"
SHARD_ENV = "HEARTH_SHARD__"
PROMPT = "the quick brown fox"
NEW_TOKENS = 8
MOVE_TIMEOUT_S = 90.0


def checkpoint_weight_bytes(path) -> int:
    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                total += tensor.numel() * tensor.element_size()
    return total


def greedy_reference(path, new_tokens: int) -> list[int]:
    input_ids = AutoTokenizer.from_pretrained(path)(PROMPT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        output = model.generate(torch.tensor([input_ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return output[0, len(input_ids):].tolist()


async def ask(cluster: LocalCluster):
    nc = await connect_nats(cluster.nats_url, name="e2e-client", settings=cluster.nats_settings())
    try:
        result = await chat(nc, ChatRequest(model=TINY_MODEL_NAME, prompt=PROMPT, max_tokens=NEW_TOKENS))
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)
    assert result.ok, result.final
    return result.token_ids, result.frames_of("pipeline")[0].hops


async def advertisements(cluster: LocalCluster, of_type: type = ShardAdvertised) -> list:
    nc = await connect_nats(cluster.nats_url, name="e2e-reader", settings=cluster.nats_settings())
    try:
        async with contextlib.aclosing(read_stream(nc.jetstream(), SHARDS_STREAM)) as messages:
            return [m.event async for m in messages if isinstance(getattr(m, "event", None), of_type)]
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)


async def test_three_budgeted_hosts_serve_a_model_none_could_hold(cluster, tiny_models_dir):
    path = tiny_models_dir / TINY_MODEL_NAME
    budget_mb = 0.4 * checkpoint_weight_bytes(path) / 2**20
    # A KV reserve small enough that two of the tiny model's six layers fit 40 % of its weights, and quick
    # rebalancing so that the move at the end happens within the test.
    cluster.extra_env.update({SHARD_ENV + "KV_CACHE_BUDGET_MB": "0.02", HOST_ENV + "REBALANCE_CHECK_INTERVAL_S": "0.3",
                              HOST_ENV + "REBALANCE_HOLD_S": "1"})
    hosts = [cluster.start_host(str(path), budget_mb, node_id=f"host-{name}") for name in "abc"]
    start_orchestrator(cluster, tiny_models_dir, wait_ready=True)
    expected = await asyncio.to_thread(greedy_reference, path, NEW_TOKENS)

    token_ids, hops = await ask(cluster)
    assert token_ids == expected
    assert hops == [f"{TINY_MODEL_NAME}:0-1@host-a", f"{TINY_MODEL_NAME}:2-3@host-b", f"{TINY_MODEL_NAME}:4-5@host-c"]
    for advertised in await advertisements(cluster):
        assert advertised.memory_required_mb <= budget_mb, advertised
        assert advertised.layer_hi - advertised.layer_lo + 1 < advertised.total_layers
        assert advertised.device_kind == "cpu" and advertised.kv_cache_budget_mb == 0.02

    # A fourth host duplicates the least replicated range (all are held once: the lowest). When host-b leaves, its
    # layers have no replica left; host-a and host-d each hold layers the other also holds, so one of them (the
    # first to look twice) moves to fill the hole, and the other then holds the last replica of 0-1 and stays.
    cluster.start_host(str(path), budget_mb, node_id="host-d")
    assert [(a.layer_lo, a.layer_hi) for a in await advertisements(cluster) if a.node_id == "host-d"] == [(0, 1)]
    hosts[1].stop()
    deadline = time.monotonic() + MOVE_TIMEOUT_S
    while not (movers := {a.node_id for a in await advertisements(cluster) if a.layer_lo == 2} - {"host-b"}):
        assert time.monotonic() < deadline, "no host moved to layers 2-3"
        await asyncio.sleep(0.5)
    assert len(movers) == 1 and movers <= {"host-a", "host-d"}
    token_ids, hops = await ask(cluster)
    assert token_ids == expected
    [mover] = movers
    assert hops[1] == f"{TINY_MODEL_NAME}:2-3@{mover}"
    assert hops[0] == f"{TINY_MODEL_NAME}:0-1@{({'host-a', 'host-d'} - movers).pop()}"


async def test_a_host_restarted_after_a_crash_takes_its_layers_back(cluster, tiny_models_dir):
    """A killed host's advert lives on until the health timeout. Restarted at once, the host counted it as a replica
    of its old layers, chose the lowest ones again and left its own held by nobody; its shards that no longer answer
    are not counted now."""
    path = tiny_models_dir / TINY_MODEL_NAME
    budget_mb = 0.4 * checkpoint_weight_bytes(path) / 2**20  # two of the six layers
    cluster.extra_env.update({SHARD_ENV + "KV_CACHE_BUDGET_MB": "0.02"})
    hosts = [cluster.start_host(str(path), budget_mb, node_id=f"host-{name}") for name in "abc"]
    hosts[2].signal(signal.SIGKILL)
    hosts[2].popen.wait(timeout=30)
    cluster.start_host(str(path), budget_mb, node_id="host-c")
    adverts = [(a.node_id, a.layer_lo, a.layer_hi) for a in await advertisements(cluster)]
    assert adverts == [("host-a", 0, 1), ("host-b", 2, 3), ("host-c", 4, 5), ("host-c", 4, 5)]


async def test_two_hosts_of_one_node_started_together_serve_different_layers(cluster, tiny_models_dir):
    """Two hosts of one node (a machine with two GPUs under one member key, started together at boot) chose the same
    layers at the same moment, and so the same shard id: one kept it, the other stopped with "already served by
    another process on this node", leaving its device idle. It chooses again now, counting the other's range."""
    path = tiny_models_dir / TINY_MODEL_NAME
    budget_mb = 0.4 * checkpoint_weight_bytes(path) / 2**20  # two of the six layers
    cluster.extra_env.update({SHARD_ENV + "KV_CACHE_BUDGET_MB": "0.02"})
    hosts = [cluster.start_host(str(path), budget_mb, node_id="two-gpu-pc", name=f"host-gpu{index}",
                                wait_ready=False) for index in range(2)]
    for host in hosts:
        cluster.wait_ready(host)
    deadline = time.monotonic() + MOVE_TIMEOUT_S
    while len(served := {host.ready_file.read_text() for host in hosts}) < 2:
        assert all(host.alive for host in hosts), [host.log_tail(600) for host in hosts]
        assert time.monotonic() < deadline, served
        await asyncio.sleep(0.5)
    assert all(host.alive for host in hosts)
    assert {shard_id.split(":")[-1] for shard_id in served} == {"0-1@two-gpu-pc", "2-3@two-gpu-pc"}


async def test_a_killed_hosts_layers_are_taken_over_once_its_silence_passes_the_health_timeout(cluster,
                                                                                              tiny_models_dir):
    """A host killed (no withdrawal) leaves its advert alive until `shard_health_timeout_s` passes without a
    heartbeat; then its layers are a hole, and a host whose layers are held elsewhere moves there: the model is
    served whole again, with the same tokens."""
    path = tiny_models_dir / TINY_MODEL_NAME
    budget_mb = 0.4 * checkpoint_weight_bytes(path) / 2**20  # two of the six layers
    cluster.extra_env.update({SHARD_ENV + "KV_CACHE_BUDGET_MB": "0.02", HOST_ENV + "REBALANCE_CHECK_INTERVAL_S": "0.3",
                              HOST_ENV + "REBALANCE_HOLD_S": "1",
                              "HEARTH_RESEARCH__DISTRIBUTED_INFERENCE__SHARD_HEALTH_TIMEOUT_S": "4"})
    hosts = [cluster.start_host(str(path), budget_mb, node_id=f"host-{name}") for name in "abcd"]  # d: 0-1 again
    start_orchestrator(cluster, tiny_models_dir, wait_ready=True)
    expected = await asyncio.to_thread(greedy_reference, path, NEW_TOKENS)
    hosts[1].signal(signal.SIGKILL)
    hosts[1].popen.wait(timeout=30)
    killed_at = time.monotonic()
    while not {a.node_id for a in await advertisements(cluster) if a.layer_lo == 2} - {"host-b"}:
        assert time.monotonic() - killed_at < MOVE_TIMEOUT_S, "no host took layers 2-3 over"
        await asyncio.sleep(0.5)
    print(f"layers 2-3 advertised again {time.monotonic() - killed_at:.1f} s after their host was killed")
    token_ids, hops = await ask(cluster)
    assert token_ids == expected
    assert len(hops) == 3 and "@host-b" not in hops[1]


async def test_a_host_killed_while_it_moves_holds_the_others_back_only_until_its_silence_passes_the_health_timeout(
        cluster, tiny_models_dir):
    """While a host moves (its range withdrawn as `moved`, its new one not advertised yet) the others decide no move
    of their own. One killed then (SIGKILL: it says nothing more) held them back the whole `move_wait_max_s` (300 s)
    before they filled the hole it was going to; now its move counts only while it is heard from (its heartbeats go
    on while it drains and loads), and another host fills the hole once its silence passes the health timeout."""
    path = tiny_models_dir / TINY_MODEL_NAME
    budget_mb = 0.4 * checkpoint_weight_bytes(path) / 2**20  # two of the six layers
    cluster.extra_env.update({SHARD_ENV + "KV_CACHE_BUDGET_MB": "0.02", HOST_ENV + "REBALANCE_CHECK_INTERVAL_S": "0.3",
                              HOST_ENV + "REBALANCE_HOLD_S": "1", SHARD_ENV + "HEARTBEAT_INTERVAL_S": "1",
                              "HEARTH_RESEARCH__DISTRIBUTED_INFERENCE__SHARD_HEALTH_TIMEOUT_S": "5",
                              # The test's hop on the mover sends no keepalives: it keeps the mover draining.
                              "HEARTH_TRANSPORT__ORPHAN_TIMEOUT_S": "600"})
    mover = cluster.start_host(str(path), budget_mb, node_id="host-a")  # 0-1, the first to move (hold 1 s)
    cluster.extra_env[HOST_ENV + "REBALANCE_HOLD_S"] = "6"
    leaving = [cluster.start_host(str(path), budget_mb, node_id=f"host-{name}") for name in "bc"][1]  # 2-3, 4-5
    for name in "de":  # 0-1 and 2-3 again: host-e (turn 1 on 2-3) can fill a hole only after host-b has
        cluster.start_host(str(path), budget_mb, node_id=f"host-{name}")
    held = [(a.node_id, a.layer_lo) for a in await advertisements(cluster)]
    assert held == [("host-a", 0), ("host-b", 2), ("host-c", 4), ("host-d", 0), ("host-e", 2)], held
    client = await connect_nats(cluster.nats_url, name="e2e-client", settings=cluster.nats_settings())
    try:  # a call going through host-a's layers keeps it draining once it moves
        opened = await open_hop_as_orchestrator(
            client, cluster, shard_control_subject("host-a", f"{TINY_MODEL_NAME}:0-1@host-a"), OpenHop(
                pipeline_id="call", session_id="s", hop=0, hop_count=1, model_id=TINY_MODEL_NAME,
                weights_sha256=weights_sha256(path), layer_lo=0, layer_hi=1, max_session_tokens=64), timeout_s=10)
        assert opened.ok, opened
        leaving.stop()  # host-c withdraws: layers 4-5 are a hole, and host-a moves first to fill it
        deadline = time.monotonic() + MOVE_TIMEOUT_S
        while not [w for w in await advertisements(cluster, ShardWithdrawn)
                   if w.node_id == "host-a" and w.reason == "moved"]:
            assert time.monotonic() < deadline, "host-a did not move"
            await asyncio.sleep(0.3)
        mover.signal(signal.SIGKILL)  # while it drains its call
        mover.popen.wait(timeout=30)
        killed_at = time.monotonic()
        while not (fillers := {a.node_id for a in await advertisements(cluster) if a.layer_lo == 4} - {"host-c"}):
            assert time.monotonic() - killed_at < MOVE_TIMEOUT_S, "nobody filled layers 4-5"
            await asyncio.sleep(0.5)
    finally:
        await asyncio.wait_for(client.close(), timeout=5)
    print(f"layers 4-5 advertised again {time.monotonic() - killed_at:.1f} s after their mover was killed")
    assert fillers == {"host-b"}, fillers
