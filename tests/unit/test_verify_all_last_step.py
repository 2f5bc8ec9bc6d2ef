"""At levels `all` and `vote` every step is checked before its token goes out; a check whose mirror failed is made
again at the next step on a fresh mirror. The last step has no next one: before the answer's last frame, what a
failed check left unchecked is checked again, so a lie on the last step is still refuted (and its token withdrawn)
rather than reaching the client unchecked."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hearth.services.orchestrator import verification as verification_module
from hearth.services.orchestrator.guards import RangeGuards
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.orchestrator.recording import ChainRecorder
from hearth.services.orchestrator.router import Hop
from hearth.services.orchestrator.verification import CallVerifier
from hearth.services.transport import FrameKind, StepInfo

HIDDEN = 8


class StandInMirror:
    """A replica that computes honestly (doubles its input), or fails to answer its first check."""

    def __init__(self, node: str, *, fails_once: bool = False) -> None:
        self.shard_id, self.dtype, self.fed_pos, self.generation = f"m:0-3@{node}", "float32", 0, 1
        self.fails_once = fails_once
        self.chain = SimpleNamespace(keep_alive=lambda: None)

    async def check(self, span):
        if self.fails_once:
            self.fails_once = False
            return StepFailure("stalled", self.shard_id, "did not answer")
        self.fed_pos = span.end_pos
        return span.inputs * 2

    async def witness(self, recorder, index, span):
        history = recorder.span(index, 0, span.last_step)
        return self, (history.inputs * 2)[:, span.first_pos:span.end_pos]

    async def close(self) -> None:
        return None


@pytest.fixture
def replicas(monkeypatch):
    """The replicas `open_mirror` hands out, in turn: the first fails its check, the others answer."""
    queue = [StandInMirror("first", fails_once=True), StandInMirror("second"), StandInMirror("third")]

    async def open_mirror(ctx, call, chain, index, avoid, chance):
        return queue.pop(0) if queue else None

    monkeypatch.setattr(verification_module, "open_mirror", open_mirror)
    return queue


async def test_a_lie_on_the_last_step_whose_check_failed_is_refuted_before_the_last_frame(replicas):
    hop = Hop(shard_id="m:0-3@liar", control_subject="c", node_id="liar", layer_lo_to_run=0, layer_hi_to_run=3,
              quantization="none")
    recorder = ChainRecorder(None, "p", ["liar"], link_keys=[None], sealed=False, step_limits=None)
    await recorder.start("s")
    chain = SimpleNamespace(hops=[hop], recorder=recorder, wire_dtype="auto")
    proved_wrong: list[str] = []
    ctx = SimpleNamespace(
        node_id="orchestrator", proved_wrong=proved_wrong, prove_wrong=proved_wrong.append,
        guards=RangeGuards(4.0, 16), canaries=SimpleNamespace(keep=lambda canary: None),
        settings=SimpleNamespace(verification=SimpleNamespace(settle_timeout_s=5.0),
                                 transport=SimpleNamespace(step_timeout_s=1.0, probe_timeout_s=1.0)))
    call = SimpleNamespace(request=SimpleNamespace(params=SimpleNamespace(verify="all")), pipeline_id="p",
                           model=SimpleNamespace(model_id="m", weights_sha256="ab" * 32), excluded={})
    events = []

    async def record(event) -> None:
        events.append(event)

    verifier = CallVerifier(call, ctx, record)
    await verifier.attach(chain)
    # The call's only step (its last): the liar's output is not what its layers compute.
    hidden = torch.randn(1, 3, HIDDEN)
    info = StepInfo(session="s", step=1, kind=FrameKind.prefill, pos=0, prompt_tokens=3)
    recorder.sent(info, hidden)
    recorder.completed(info, hidden * 2 + 1)
    verifier.after_step()
    assert await verifier.verify_step() is None, "its mirror failed: nothing refuted yet"
    refuted = await verifier.settle()
    assert refuted is not None and refuted.kind == "refuted" and refuted.shard_id == hop.shard_id
    assert refuted.rewind_to == 0
    assert proved_wrong == [hop.shard_id]
