"""A `reset` step (no activations: drop the session's cache) is never sent by an orchestrator, so one arriving on a link
was made by the hop before, which holds the link key: a hop reports it as refused input (blaming nobody, routing around
the hop before for the call) and neither drops its cache nor passes it on; and the orchestrator's sink takes a reset
that the last hop sent as a step's output as that hop's corrupt output, rather than failing the call on a step without
a tensor (which blamed nobody: a member's shard could end every call it served unblamed)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from hearth.services.common.config import TransportSettings
from hearth.services.orchestrator.chain import HopChain, SentStep
from hearth.services.orchestrator.router import Hop
from hearth.services.shard.compute import ShardCompute
from hearth.services.transport import FrameKind, ReceivedStep, StepInfo, encode_step
from hearth.inference import load_layer_range
from tests.runner_limits import RUNNER_KV_LIMITS

from .inference_tiny_models import TINY_NUM_LAYERS, tiny_model_dir  # noqa: F401
from .test_hop_input_blame import _hop, _Publishes, _step
from .test_layer_slices import shard_settings


def _reset(step: int, session: str, pipeline: str, hop: int) -> ReceivedStep:
    header = encode_step(StepInfo(session=session, step=step, kind=FrameKind.reset), None).header(pipeline, hop, 0)
    return ReceivedStep(header, None, None, 0, None, 0.0)


async def test_a_hop_reports_a_reset_of_its_session_and_keeps_its_cache(tiny_model_dir):
    runner = load_layer_range(tiny_model_dir("llama"), 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS)
    try:
        nc = _Publishes()
        hop = _hop(nc, ShardCompute(runner, "shard-1", shard_settings()))
        await hop._run_step(_step(1, FrameKind.prefill, 0, torch.randn(1, 3, runner.info.hidden_size)))
        await hop._run_step(_reset(2, "s", "p1", 1))
        assert [(notice.step, notice.problem, notice.check) for notice in nc.notices()] == [
            (2, "input_failed_check", "shape")]
        assert runner.session_bytes("p1/s") > 0  # the session's cache is still there
        assert not [subject for subject, _ in nc.published if subject.startswith("hearth.act.")]  # not passed on
    finally:
        runner.close()


async def test_a_reset_as_a_steps_output_is_the_last_hops_corrupt_output():
    hops = [Hop(shard_id=f"shard-{index}", control_subject=f"hearth.ctl.n{index}.shard-{index}", node_id=f"n{index}",
                layer_lo_to_run=index, layer_hi_to_run=index) for index in range(2)]
    connection = SimpleNamespace(max_payload=2**20, stats={"reconnects": 0}, is_connected=True)
    chain = HopChain(connection, "pipe", hops, node_id="orchestrator", model_id="tiny", weights_sha256="0" * 64,
                     transport=TransportSettings(), hidden_size=64, max_session_tokens=128)
    info = StepInfo(session=chain.session_id, step=3, kind=FrameKind.decode, pos=5)
    chain._outstanding.add(info.step)
    chain._sink._ready.append(_reset(info.step, chain.session_id, "pipe", len(hops)))
    failure = await chain._await_output(SentStep(info, time.monotonic(), 10.0, False, chain.nc.stats["reconnects"], 1))
    assert (failure.kind, failure.shard_id, failure.check) == ("corrupt", "shard-1", "shape"), failure
