"""A call's last frame says whether its `verify` level was held to, over real processes: a call at a level that needs
other replicas of its hops' layers, on a mesh without them, ends `done` with `verification: unmet` (its hops' work
unchecked), and so does its `pipeline.completed`; with a replica of every range, `all` is `met` (and `vote`, which
asks two, is still `unmet`); at `none` nothing is said. A replica of the whole model beside the two is not routed
alone where checks are asked (nobody could check it): the call gets a chain every hop of which another node can
check, and is `met`. One mesh serves the module: two shards over layers 0-2 and 3-5; the later tests start the
replicas they need."""

from __future__ import annotations

import pytest

from hearth.protocol.chat import ChatParams, ChatRequest
from tests.e2e.conftest import TINY_MODEL_NAME
from tests.e2e.failover_support import (  # noqa: F401 (nc is a fixture)
    PIPELINES_STREAM,
    PRIMARY_WEIGHT,
    REPLICA_WEIGHT,
    failover_mesh,
    nc,
    stream_with_action,
    wait_for_event,
)

pytestmark = pytest.mark.timeout(600)

RANGES = [(0, 2), (3, 5)]
# The two partial shards ask to be used last (a weight above 1 is always honoured), by so much that a chain of both
# costs more than the whole replica alone even when that replica's measured step is many times theirs or a
# heartbeat sent while it checked the call before says it has steps queued: which chain an unchecked call takes
# must not rest on step times and queues measured on a loaded machine.
PARTIAL_WEIGHT = 50.0
MESH_ENV = {"HEARTH_VERIFICATION__CANARY_INTERVAL_S": "0"}


def request(verify: str) -> ChatRequest:
    return ChatRequest(model=TINY_MODEL_NAME, prompt="the quick brown fox jumps over", max_tokens=6, temperature=0.0,
                       params=ChatParams(fallback_to_local=False, verify=verify))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    with failover_mesh(tmp_path_factory, tiny_models_dir, "verification-unmet", extra_env=MESH_ENV) as mesh:
        yield mesh.serve([(f"h{index}", lo, hi, PARTIAL_WEIGHT) for index, (lo, hi) in enumerate(RANGES)])


async def completed_event(nc, pipeline_id: str):
    stored = await wait_for_event(nc, PIPELINES_STREAM, lambda item: item.event.type == "pipeline.completed"
                                  and item.event.pipeline_id == pipeline_id, timeout_s=30)
    return stored.event


async def test_a_level_no_replica_can_hold_is_said_unmet(mesh, nc):
    for level in ("sampled", "all", "vote"):
        call = await stream_with_action(nc, request(level))
        assert call.final.type == "done", call.final
        assert call.final.verification == "unmet", level
        (pipeline,) = call.of_type("pipeline")
        assert (await completed_event(nc, pipeline.pipeline_id)).verification == "unmet"
    unchecked = await stream_with_action(nc, request("none"))
    assert unchecked.final.type == "done" and unchecked.final.verification is None


async def test_a_level_the_replicas_hold_is_said_met(mesh, nc):
    async with mesh.extra_shards() as start:
        for index, (lo, hi) in enumerate(RANGES):
            await start(f"r{index}", lo, hi, REPLICA_WEIGHT)
        call = await stream_with_action(nc, request("all"))
        assert call.final.type == "done", call.final
        assert call.final.verification == "met"
        (pipeline,) = call.of_type("pipeline")
        assert (await completed_event(nc, pipeline.pipeline_id)).verification == "met"
        # A vote asks two other replicas of each range: one is not enough.
        vote = await stream_with_action(nc, request("vote"))
        assert vote.final.type == "done" and vote.final.verification == "unmet"


async def test_a_whole_replica_beside_partial_shards_gets_a_chain_it_can_check(mesh, nc):
    """A replica of every layer beside the two partial shards: alone it is the cheapest chain (one hop), which no other
    replica could check; a call that asks checks is routed over a chain every hop of which another node can mirror."""
    async with mesh.extra_shards() as start:
        whole = await start("whole", 0, 5, PRIMARY_WEIGHT)
        call = await stream_with_action(nc, request("all"))
        assert call.final.type == "done", call.final
        (pipeline,) = call.of_type("pipeline")
        assert call.final.verification == "met", pipeline.hops
        assert (await completed_event(nc, pipeline.pipeline_id)).verification == "met"
        assert len(pipeline.hops) == 2
        # A call that asks no checks still takes the cheapest chain: the whole replica alone.
        unchecked = await stream_with_action(nc, request("none"))
        (pipeline,) = unchecked.of_type("pipeline")
        assert pipeline.hops == [whole.shard_id], pipeline.hops
