"""The output of a step has as many positions as the step sent: a last hop that answered a one-token decode step with
more positions (labelled a prefill, which the frame limits allow any length) had its output taken, and the checks of
its work on other replicas then failed to compare outputs of two lengths, so a liar evaded them all. Such an output is
now refused: the call is routed around the last hop, and nobody is blamed, since a hop before it may have changed the
step (hops pass the header on as they got it)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from hearth.services.common.config import TransportSettings
from hearth.services.orchestrator.chain import HopChain, SentStep
from hearth.services.orchestrator.router import Hop
from hearth.services.transport import FrameKind, ReceivedStep, StepInfo, encode_step

HIDDEN = 64


def _chain() -> HopChain:
    hops = [Hop(shard_id=f"shard-{index}", control_subject=f"hearth.ctl.n{index}.shard-{index}", node_id=f"n{index}",
                layer_lo_to_run=index, layer_hi_to_run=index) for index in range(2)]
    connection = SimpleNamespace(max_payload=2**20, stats={"reconnects": 0}, is_connected=True)
    return HopChain(connection, "pipe", hops, node_id="orchestrator", model_id="tiny", weights_sha256="0" * 64,
                    transport=TransportSettings(), hidden_size=HIDDEN, max_session_tokens=128)


def _output(chain: HopChain, step: int, kind: FrameKind, pos: int, tokens: int) -> ReceivedStep:
    tensor = torch.ones(1, tokens, HIDDEN)
    header = encode_step(StepInfo(session=chain.session_id, step=step, kind=kind, pos=pos), tensor).header("pipe", 2, 0)
    return ReceivedStep(header, tensor, None, 0, None, 0.0)


async def _await(chain: HopChain, info: StepInfo, tokens: int, output: ReceivedStep):
    chain._outstanding.add(info.step)
    chain._sink._ready.append(output)
    return await chain._await_output(SentStep(info, time.monotonic(), 10.0, False, tokens))


async def test_an_output_of_more_positions_than_the_step_sent_is_refused_blaming_nobody():
    chain = _chain()
    info = StepInfo(session=chain.session_id, step=3, kind=FrameKind.decode, pos=5)
    failure = await _await(chain, info, 1, _output(chain, 3, FrameKind.prefill, 5, 4))
    assert (failure.kind, failure.shard_id, failure.verified) == ("reported", "shard-1", False), failure


async def test_an_output_of_the_steps_positions_is_taken():
    chain = _chain()
    info = StepInfo(session=chain.session_id, step=3, kind=FrameKind.prefill, pos=0)
    output = await _await(chain, info, 6, _output(chain, 3, FrameKind.prefill, 0, 6))
    assert isinstance(output, torch.Tensor) and output.shape == (1, 6, HIDDEN)
