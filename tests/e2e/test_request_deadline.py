"""A call that runs past `[orchestrator] request_deadline_s`, with real processes: it ends with a `pipeline_aborted`
frame, code `pipeline_stalled`, whose reason names the setting and its value; every hop is closed, and the
pipeline's `pipeline.aborted` event says why. One mesh: three shards over the tiny model, the first slowed by
STEP_DELAY_S a step, and an orchestrator whose deadline is far shorter than the call."""

from __future__ import annotations

import pytest

from hearth.services.client.chat import stream_chat
from tests.e2e.conftest import THREE_SHARD_RANGES
from tests.e2e.failover_support import (  # noqa: F401 (nc is a fixture)
    PRIMARY_WEIGHT,
    failover_mesh,
    leaving_client_request,
    nc,
    pipeline_events,
    wait_until_released,
)

pytestmark = pytest.mark.timeout(300)

DEADLINE_S = 3.0
# 960 steps of at least this: far past DEADLINE_S on any machine.
STEP_DELAY_S = 0.05


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    env = {"HEARTH_ORCHESTRATOR__REQUEST_DEADLINE_S": str(DEADLINE_S)}
    with failover_mesh(tmp_path_factory, tiny_models_dir, "request-deadline", extra_env=env) as mesh:
        for index, (lo, hi) in enumerate(THREE_SHARD_RANGES):
            mesh.start_shard(f"p{index}", lo, hi, hop_weight=PRIMARY_WEIGHT, wait_ready=False,
                             fault=f"delay_s={STEP_DELAY_S}" if index == 0 else None)
        mesh.start_orchestrator(local_model=False)
        mesh.cluster.wait_all_ready()
        mesh.wait_all_advertised()
        yield mesh


async def test_a_call_past_its_deadline_is_aborted_naming_it_with_its_hops_closed(mesh, nc):
    pipeline_id = None
    frames = []
    async for frame in stream_chat(nc, leaving_client_request()):
        if frame.type == "pipeline":
            pipeline_id = frame.pipeline_id
        frames.append(frame)
    final = frames[-1]
    assert (final.type, final.code) == ("pipeline_aborted", "pipeline_stalled"), final
    named = f"[orchestrator] request_deadline_s ({DEADLINE_S:g} s)"
    assert named in final.reason
    assert any(frame.type == "token_delta" for frame in frames)  # it was cut off mid-answer

    stats = await wait_until_released(nc, mesh.live_shards())
    assert all(s.active_streams == 0 and s.cached_sessions == 0 for s in stats.values()), stats
    events = await pipeline_events(nc, pipeline_id)
    last = events[-1].event
    assert (last.type, last.code) == ("pipeline.aborted", "pipeline_stalled")
    assert named in last.reason
