"""HopInputChecks: a shard learns its input norm bounds per member that opened the hops, so no one member, however
many pipelines it opens, widens the bound another member's corrupted input is checked against."""

from __future__ import annotations

import torch

from hearth.protocol.control import OpenHop
from hearth.services.shard.input_checks import HopInputChecks
from hearth.services.transport import FrameKind, ReceivedStep
from hearth.services.transport.frames import encode_step
from hearth.services.transport.headers import StepInfo


def _hop(pipeline_id: str) -> OpenHop:
    return OpenHop(pipeline_id=pipeline_id, session_id="s", hop=1, hop_count=2, model_id="tiny",
                   weights_sha256="0" * 64, layer_lo=2, layer_hi=3)


def _step(pipeline_id: str, seed: int, scale: float = 1.0) -> ReceivedStep:
    tensor = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(seed)) * scale
    header = encode_step(StepInfo(session="s", step=0, kind=FrameKind.prefill, pos=0), tensor).header(pipeline_id, 1, 0)
    return ReceivedStep(header, tensor, None, 0, None, 0.0)


def test_one_members_many_pipelines_do_not_widen_the_bound_for_another_member() -> None:
    """Before, each pipeline was a source: one member's three pipelines of 1e4x activations made the bound, and
    another member's 1e4x corrupted input passed."""
    checks = HopInputChecks()
    for index in range(3):
        pipeline = f"mallory-{index}"
        assert checks.check(_hop(pipeline), _step(pipeline, index, 1e4), opener="mallory") is None
    assert checks.check(_hop("bob-0"), _step("bob-0", 10), opener="bob") is None
    assert checks.check(_hop("bob-0"), _step("bob-0", 11, 1e4), opener="bob") == "norm"
    # ... nor once enough members are known that one shared bound applies.
    assert checks.check(_hop("carol-0"), _step("carol-0", 12), opener="carol") is None
    assert checks.check(_hop("bob-1"), _step("bob-1", 13, 1e4), opener="bob") == "norm"
    assert checks.check(_hop("dave-0"), _step("dave-0", 14), opener="dave") is None
    assert checks.check(_hop("dave-0"), _step("dave-0", 15, 1e4), opener="dave") == "norm"


def test_honest_members_inputs_pass_beside_a_member_sending_huge_ones() -> None:
    checks = HopInputChecks()
    for index in range(4):
        assert checks.check(_hop(f"mallory-{index}"), _step(f"mallory-{index}", index, 1e4), opener="mallory") is None
    for round_ in range(5):
        for member in ("bob", "carol", "dave"):
            pipeline = f"{member}-{round_}"
            assert checks.check(_hop(pipeline), _step(pipeline, 100 + round_, 2.0), opener=member) is None


def test_on_an_open_mesh_each_pipeline_is_a_source() -> None:
    checks = HopInputChecks()
    assert checks.check(_hop("p-0"), _step("p-0", 0, 1e-4), opener=None) is None
    assert checks.check(_hop("p-1"), _step("p-1", 1), opener=None) is None  # its own first frame: nothing known
    assert checks.check(_hop("p-1"), _step("p-1", 2, 1e4), opener=None) == "norm"


def test_a_host_before_one_of_a_members_pipelines_does_not_ratchet_that_members_bound() -> None:
    """With fewer than three members (one household's orchestrator), a member's own bounds are shared by its pipelines:
    frames raised 40x a step each on one pipeline fail before a 1e4x one could pass, there and on its other ones."""
    checks = HopInputChecks()
    for index in range(3):
        assert checks.check(_hop(f"solo-{index}"), _step(f"solo-{index}", index), opener="solo") is None
    scale, failed = 1.0, None
    for step in range(4):
        scale *= 40.0
        failed = checks.check(_hop("solo-liar"), _step("solo-liar", 10 + step, scale), opener="solo")
        if failed is not None:
            break
    assert failed == "norm" and scale <= 40.0 ** 2
    assert checks.check(_hop("solo-1"), _step("solo-1", 20, 1e4), opener="solo") == "norm"
    assert checks.check(_hop("solo-2"), _step("solo-2", 21), opener="solo") is None
