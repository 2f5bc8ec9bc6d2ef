"""The output of a step has as many positions as the step sent: a last hop that answered a one-token decode step with
more positions (labelled a prefill, which the frame limits allow any length) had its output taken, and the checks of
its work on other replicas then failed to compare outputs of two lengths, so a liar evaded them all. Such an output is
now refused. Hops pass a step on as they got it, so which hop changed it is what the chain's taps saw (one publish
reaches the next hop and the tap alike): that hop is blamed; without a copy on every link nobody is, and the call is
routed around the last hop."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from hearth.services.common.config import TransportSettings
from hearth.services.orchestrator.chain import HopChain, SentStep
from hearth.services.orchestrator.router import Hop
from hearth.services.transport import FrameKind, ReceivedStep, StepInfo, encode_step

HIDDEN = 64


def _chain(record_budget_bytes: int | None = None) -> HopChain:
    hops = [Hop(shard_id=f"shard-{index}", control_subject=f"hearth.ctl.n{index}.shard-{index}", node_id=f"n{index}",
                layer_lo_to_run=index, layer_hi_to_run=index) for index in range(2)]
    connection = SimpleNamespace(max_payload=2**20, stats={"reconnects": 0}, is_connected=True)
    return HopChain(connection, "pipe", hops, node_id="orchestrator", model_id="tiny", weights_sha256="0" * 64,
                    transport=TransportSettings(), hidden_size=HIDDEN, max_session_tokens=128,
                    record_budget_bytes=record_budget_bytes)


def _output(chain: HopChain, step: int, kind: FrameKind, pos: int, tokens: int, hop: int = 2) -> ReceivedStep:
    tensor = torch.ones(1, tokens, HIDDEN)
    header = encode_step(StepInfo(session=chain.session_id, step=step, kind=kind, pos=pos), tensor).header("pipe", hop,
                                                                                                              0)
    return ReceivedStep(header, tensor, None, 0, None, 0.0)


async def _await(chain: HopChain, info: StepInfo, tokens: int, output: ReceivedStep):
    chain._outstanding.add(info.step)
    chain._sink._ready.append(output)
    sent = SentStep(info, time.monotonic(), 10.0, False, chain.nc.stats["reconnects"], tokens)
    return await chain._await_output(sent)


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


async def test_the_hop_the_taps_saw_change_the_positions_is_the_one_blamed():
    for tapped_tokens, culprit in ((4, "shard-0"), (1, "shard-1")):
        chain = _chain(record_budget_bytes=2**20)
        chain.recorder._session = chain.session_id  # as start() sets it, without subscribing
        info = StepInfo(session=chain.session_id, step=3, kind=FrameKind.decode, pos=5)
        chain.recorder.sent(info, torch.ones(1, 1, HIDDEN))
        # What the tap of the link into hop 1 read: hop 0's output of the step.
        chain.recorder._taps[0]._ready.append(_output(chain, 3, FrameKind.prefill, 5, tapped_tokens, hop=1))
        failure = await _await(chain, info, 1, _output(chain, 3, FrameKind.prefill, 5, 4))
        assert (failure.kind, failure.shard_id, failure.check, failure.verified) == ("corrupt", culprit, "shape",
                                                                                      True), failure
