"""A step whose header does not continue the hop's session (a position past its cache, a decode of a session it never
prefilled, a step after a reset the hop before injected) is its input's fault, not the hop's: the hop reports its input
(`input_failed_check`, which blames nobody) rather than itself (`step_failed`, which the orchestrator blames on it).
The hop before holds the key of the link into this hop and may write any header, so a self-blame here would let it
get an honest host blamed and routed around in every call."""

from __future__ import annotations

import json

import torch

from hearth.inference import load_layer_range
from hearth.protocol.control import HopNotice, OpenHop
from hearth.services.common.config import TransportSettings
from hearth.services.orchestrator.hop_notices import notice_failure
from hearth.services.orchestrator.router import Hop
from hearth.services.shard.compute import ShardCompute
from hearth.services.shard.hops import HopLimits, ServedHop
from hearth.services.transport import FrameKind, ReceivedStep, StepInfo, encode_step
from tests.runner_limits import RUNNER_KV_LIMITS

from .inference_tiny_models import TINY_NUM_LAYERS, tiny_model_dir  # noqa: F401
from .test_layer_slices import shard_settings


class _Publishes:
    """A connection that keeps what is published (the hop's notices and frames) instead of sending it."""

    max_payload = 2**20

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, payload: bytes, headers=None) -> None:
        self.published.append((subject, bytes(payload)))

    def notices(self) -> list[HopNotice]:
        return [HopNotice.model_validate(json.loads(payload)) for subject, payload in self.published
                if subject.startswith("hearth.notice.")]


def _step(step: int, kind: FrameKind, pos: int, tensor: torch.Tensor) -> ReceivedStep:
    header = encode_step(StepInfo(session="s", step=step, kind=kind, pos=pos), tensor).header("p1", 1, 0)
    return ReceivedStep(header, tensor, None, 0, None, 0.0)


def _hop(nc, compute: ShardCompute) -> ServedHop:
    request = OpenHop(pipeline_id="p1", session_id="s", hop=1, hop_count=2, model_id="tiny", weights_sha256="0" * 64,
                      layer_lo=0, layer_hi=TINY_NUM_LAYERS - 1, max_session_tokens=64)
    limits = HopLimits(idle_timeout_s=60.0, orphan_timeout_s=60.0, close_timeout_s=1.0, transport=TransportSettings())
    return ServedHop(nc, request, compute, limits, "node1")


async def test_a_step_that_does_not_continue_the_session_is_reported_as_input_not_as_this_hops_failure(
        tiny_model_dir):
    runner = load_layer_range(tiny_model_dir("llama"), 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS)
    try:
        nc = _Publishes()
        hop = _hop(nc, ShardCompute(runner, "shard-1", shard_settings()))
        hidden = runner.info.hidden_size
        # A decode of a session this hop never prefilled, then one that skips positions past its cache.
        await hop._run_step(_step(1, FrameKind.decode, 4, torch.randn(1, 1, hidden)))
        await hop._run_step(_step(2, FrameKind.prefill, 0, torch.randn(1, 3, hidden)))
        await hop._run_step(_step(3, FrameKind.decode, 7, torch.randn(1, 1, hidden)))

        notices = nc.notices()
        assert [(notice.step, notice.problem, notice.check) for notice in notices] == [
            (1, "input_failed_check", "shape"), (3, "input_failed_check", "shape")]
        assert all(notice.message.startswith("input refused: ") for notice in notices)
        # What the orchestrator makes of it: the hop before is routed around for the call, and nobody is blamed.
        hops = [Hop(shard_id=f"shard-{index}", control_subject=f"hearth.ctl.n{index}.shard-{index}",
                    node_id=f"n{index}", layer_lo_to_run=0, layer_hi_to_run=0) for index in range(2)]
        failure = notice_failure(notices[0], hops, set())
        assert (failure.kind, failure.shard_id, failure.verified) == ("reported", "shard-0", False)
    finally:
        runner.close()
