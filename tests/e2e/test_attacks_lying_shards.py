"""Lying shard hosts over real processes: a member's shard that computes its layers wrongly (x40 from its first
step, honest for a while and then x40) is caught by a check on other replicas, quarantined through the event log,
and the call it served still answers with the honest greedy tokens; a liar checking an honest host is the one
quarantined. One mesh serves the module: honest shards over layers 0-1 and 4-5, two honest replicas of layers 2-3
(a check's verifier and witness), an orchestrator; each test starts its own liar for layers 2-3, preferred by the
router (hop_weight 0.5), and stops it at the end."""

from __future__ import annotations

import asyncio

import pytest

from protocol.chat import TokenDeltaFrame, TokensWithdrawnFrame
from tests.e2e.conftest import THREE_SHARD_RANGES
from tests.e2e.failover_support import (  # noqa: F401 (nc is a fixture)
    PIPELINES_STREAM,
    PREFERRED_WEIGHT,
    PRIMARY_WEIGHT,
    REPLICA_WEIGHT,
    chat_request,
    failover_mesh,
    nc,
    run_reference_call,
    stream_with_action,
    wait_for_event,
)

pytestmark = pytest.mark.timeout(600)

CHECKED_HOP = 1
# Guards judge after few confirmed positions here, so a host that turns liar mid-call leaves them at once; and a
# quarter of the steps are checked, so a lying verifier is met within a few calls; no canaries here
# (tests/e2e/test_canaries.py), so each liar is caught by what these tests look at.
MESH_ENV = {"HEARTH_VERIFICATION__GUARD_MIN_POSITIONS": "4", "HEARTH_VERIFICATION__SAMPLE_RATE": "0.25",
            "HEARTH_VERIFICATION__CANARY_INTERVAL_S": "0"}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    with failover_mesh(tmp_path_factory, tiny_models_dir, "lying-shards", extra_env=MESH_ENV) as mesh:
        for index, (lo, hi) in enumerate(THREE_SHARD_RANGES):
            mesh.start_shard(f"h{index}", lo, hi, hop_weight=PRIMARY_WEIGHT, wait_ready=False)
        lo, hi = THREE_SHARD_RANGES[CHECKED_HOP]
        mesh.start_shard("r1", lo, hi, hop_weight=REPLICA_WEIGHT, wait_ready=False)
        mesh.start_orchestrator(local_model=False)
        mesh.cluster.wait_all_ready()
        mesh.wait_all_advertised()
        yield mesh


@pytest.fixture(scope="module")
def reference(mesh):
    call = run_reference_call(mesh.cluster)
    assert call.final.type == "done", call.final
    return call


@pytest.fixture
async def liar(mesh):
    """start(node_id, fault, hop_weight): a shard over the checked hop's layers that lies; stopped after."""
    started = []

    async def start(node_id: str, fault: str, hop_weight: float = PREFERRED_WEIGHT):
        lo, hi = THREE_SHARD_RANGES[CHECKED_HOP]
        handle = await asyncio.to_thread(mesh.start_shard, node_id, lo, hi, hop_weight=hop_weight, fault=fault)
        started.append(handle)
        await mesh.wait_advertised(handle)
        return handle

    yield start
    for handle in started:
        await asyncio.to_thread(mesh.stop_shard, handle)


def answer_tokens(frames: list) -> list[int]:
    """The token ids of the answer as a client keeps them: withdrawn deltas dropped."""
    tokens: list[int] = []
    for frame in frames:
        if isinstance(frame, TokenDeltaFrame):
            tokens.append(frame.token_id)
        elif isinstance(frame, TokensWithdrawnFrame):
            del tokens[frame.kept_tokens:]
    return tokens


def hops_of(call) -> list[str]:
    pipeline = call.of_type("pipeline")[0]
    return list(pipeline.hops) + [hop for frame in call.of_type("shard_failover") for hop in frame.replacement_hops]


async def confirmed_against(nc, shard_id: str):
    return await wait_for_event(nc, PIPELINES_STREAM, lambda item: item.event.type == "integrity.mismatch_confirmed"
                                and item.event.shard_id == shard_id, timeout_s=30)


async def test_a_host_lying_from_its_first_step_is_quarantined_and_the_answer_stays_honest(mesh, reference, nc,
                                                                                          liar):
    x = await liar("x40", "scale=40")
    call = await stream_with_action(nc, chat_request())
    assert call.final.type == "done", call.final
    assert x.shard_id in hops_of(call), "the router was to pick the preferred liar first"
    assert answer_tokens(call.frames) == reference.token_ids
    assert call.of_type("shard_failover"), "the refuted call fails over around the liar"
    stored = await confirmed_against(nc, x.shard_id)
    evidence = stored.event
    assert len(evidence.witnesses) == 2 and x.shard_id not in evidence.witnesses
    assert evidence.relative_error > evidence.tolerance
    # Quarantined: the next call never goes near it.
    again = await stream_with_action(nc, chat_request())
    assert again.final.type == "done" and x.shard_id not in hops_of(again)
    assert answer_tokens(again.frames) == reference.token_ids


async def test_a_host_honest_for_a_while_then_lying_is_caught_by_the_learned_guard(mesh, reference, nc, liar):
    x = await liar("late-liar", "after_steps=6,scale=40")
    call = await stream_with_action(nc, chat_request())
    assert call.final.type == "done", call.final
    assert x.shard_id in hops_of(call)
    assert answer_tokens(call.frames) == reference.token_ids
    await confirmed_against(nc, x.shard_id)


async def test_a_lying_verifier_is_the_one_quarantined(mesh, reference, nc, liar):
    # The liar is never the primary (the honest h1 is preferred over it): it can only lie as the replica that
    # checks h1. Each call's check picks its verifier at random from r1 and the liar, so a few calls meet it.
    x = await liar("false-witness", "scale=40", hop_weight=REPLICA_WEIGHT * 2)
    for _ in range(8):
        call = await stream_with_action(nc, chat_request())
        assert call.final.type == "done", call.final
        assert answer_tokens(call.frames) == reference.token_ids
        assert not call.of_type("tokens_withdrawn"), "an honest primary's tokens are never withdrawn"
    stored = await confirmed_against(nc, x.shard_id)
    assert mesh.shards["h1"].shard_id in stored.event.witnesses
