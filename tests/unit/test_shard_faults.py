"""The lies a faulty shard host can be started with (`--fault`, hearth/services/shard/faults.py): each corrupts what it
says it does, from the step it says, and leaves every honest step bit-identical."""

from __future__ import annotations

import pydantic
import pytest
import torch

from hearth.inference import load_head, load_layer_range
from hearth.inference.activation_compare import position_errors
from hearth.protocol.control import OpenHop
from hearth.services.shard.compute import ShardCompute
from hearth.services.shard.faults import ShardFault
from hearth.services.transport import FrameKind
from tests.runner_limits import RUNNER_KV_LIMITS

from .inference_tiny_models import TINY_NUM_LAYERS, tiny_model_dir  # noqa: F401
from .test_layer_slices import _received, shard_settings

HIDDEN = 256


def _output(positions: int = 6, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, positions, HIDDEN, generator=generator).to(dtype)


def _hop(hop_count: int) -> OpenHop:
    return OpenHop(pipeline_id="p1", session_id="s1", hop=0, hop_count=hop_count, model_id="tiny",
                   weights_sha256="0" * 64, layer_lo=0, layer_hi=1)


def test_the_new_faults_parse_from_a_spec_and_bad_values_are_refused():
    fault = ShardFault.parse("noise=0.01,offset=-0.5,bitflip=30,lie_rate=0.25,fault_seed=7,spare_single_hop,"
                             "after_steps=3")
    assert (fault.noise, fault.offset, fault.bitflip, fault.lie_rate, fault.fault_seed) == (0.01, -0.5, 30, 0.25, 7)
    assert fault.spare_single_hop and fault.after_steps == 3
    for bad in ("bitflip=32", "lie_rate=1.5", "noise=0", "noise=-1", "lying=1"):
        with pytest.raises(pydantic.ValidationError):
            ShardFault.parse(bad)


@pytest.mark.parametrize("spec", ["scale=1.01", "noise=0.01", "offset=0.1", "bitflip=30", "nan"])
def test_each_fault_leaves_the_steps_before_after_steps_bit_identical_then_corrupts_every_step(spec):
    fault = ShardFault.parse(f"{spec},after_steps=2,fault_seed=1")
    for step in range(2):
        honest = _output(seed=step)
        assert fault.corrupt(honest) is honest
    for step in range(2, 5):
        honest = _output(seed=step)
        claimed = fault.corrupt(honest.clone())
        assert claimed.shape == honest.shape and claimed.dtype == honest.dtype
        assert not torch.equal(claimed, honest)
        assert torch.equal(honest, _output(seed=step))  # the computed output itself is left alone


def test_noise_moves_each_position_by_about_its_relative_size_and_a_seed_reproduces_it():
    honest = _output(positions=64)
    claimed = ShardFault.parse("noise=0.01,fault_seed=5").corrupt(honest)
    errors = position_errors(claimed, honest)
    assert errors.min() > 0.008 and errors.max() < 0.012
    assert torch.equal(ShardFault.parse("noise=0.01,fault_seed=5").corrupt(honest), claimed)
    assert not torch.equal(ShardFault.parse("noise=0.01,fault_seed=6").corrupt(honest), claimed)


def test_offset_adds_the_constant_to_every_element():
    honest = _output()
    claimed = ShardFault.parse("offset=0.1").corrupt(honest)
    torch.testing.assert_close(claimed - honest, torch.full_like(honest, 0.1), rtol=0, atol=1e-6)


def test_scale_multiplies_the_output():
    honest = _output()
    torch.testing.assert_close(ShardFault.parse("scale=1.01").corrupt(honest), honest * 1.01, rtol=0, atol=0)


@pytest.mark.parametrize(("dtype", "bit", "bit_flipped", "view"), [
    (torch.float32, 30, 30, torch.int32), (torch.float32, 31, 31, torch.int32), (torch.float32, 3, 3, torch.int32),
    (torch.bfloat16, 30, 14, torch.int16), (torch.float16, 30, 14, torch.int16), (torch.bfloat16, 5, 5, torch.int16)])
def test_bitflip_flips_that_bit_of_exactly_one_element_per_position(dtype, bit, bit_flipped, view):
    honest = _output(positions=16, dtype=dtype)
    claimed = ShardFault.parse(f"bitflip={bit},fault_seed=2").corrupt(honest)
    changed = claimed.view(view) ^ honest.view(view)
    assert (changed != 0).sum(dim=-1).tolist() == [[1] * 16]
    flipped = changed[changed != 0]
    expected_mask = torch.tensor(1, dtype=view) << bit_flipped
    assert torch.equal(flipped, expected_mask.expand_as(flipped))


def test_a_top_exponent_bit_flip_throws_the_position_far_off():
    honest = _output(positions=32) * 0.1  # every element below 2 in magnitude: the flip makes it enormous
    claimed = ShardFault.parse("bitflip=30,fault_seed=3").corrupt(honest)
    assert bool((position_errors(claimed, honest) > 1e6).all())


def test_lie_rate_corrupts_about_that_fraction_of_steps_the_same_ones_for_a_seed_and_spares_the_rest():
    def corrupted_steps(seed: int) -> list[int]:
        fault = ShardFault.parse(f"scale=40,lie_rate=0.25,fault_seed={seed}")
        steps = []
        for step in range(400):
            honest = _output(positions=1, seed=step)
            claimed = fault.corrupt(honest)
            if claimed is honest:
                continue
            assert torch.equal(claimed, honest * 40)
            steps.append(step)
        return steps

    first = corrupted_steps(11)
    assert 60 <= len(first) <= 140
    assert corrupted_steps(11) == first
    assert corrupted_steps(12) != first


def test_lie_rate_zero_never_lies_and_one_always_does():
    never, always = ShardFault.parse("offset=1,lie_rate=0"), ShardFault.parse("offset=1,lie_rate=1")
    for step in range(20):
        honest = _output(seed=step)
        assert never.corrupt(honest) is honest
        assert not torch.equal(always.corrupt(honest), honest)


def test_spare_single_hop_never_corrupts_a_one_hop_pipeline_s_steps():
    fault = ShardFault.parse("scale=40,spare_single_hop")
    honest = _output()
    assert fault.corrupt(honest, _hop(hop_count=1)) is honest
    assert torch.equal(fault.corrupt(honest, _hop(hop_count=3)), honest * 40)
    # Without the option a one-hop pipeline's steps are corrupted like any other.
    assert torch.equal(ShardFault.parse("scale=40").corrupt(honest, _hop(hop_count=1)), honest * 40)


async def test_a_shard_with_spare_single_hop_answers_a_one_hop_check_honestly_and_lies_in_a_pipeline(tiny_model_dir):
    """Through ShardCompute, which hands the fault the step's hop: the same input gives the honest output to a
    pipeline of one hop (a verifier's re-run) and a corrupted one to a hop of a longer pipeline."""
    path = tiny_model_dir("llama")
    head = load_head(path)
    honest_runner = load_layer_range(path, 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS)
    compute = ShardCompute(load_layer_range(path, 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS), "shard-0",
                           shard_settings(), fault=ShardFault.parse("noise=0.05,spare_single_hop,fault_seed=4"))
    hidden = head.embed(head.encode_prompt("the quick brown fox"))
    expected = honest_runner.forward("s", hidden, 0, "prefill")
    for hop_count, lies in ((1, False), (2, True)):
        hop = OpenHop(pipeline_id="p1", session_id=f"s{hop_count}", hop=0, hop_count=hop_count, model_id="tiny",
                      weights_sha256="0" * 64, layer_lo=0, layer_hi=TINY_NUM_LAYERS - 1)
        result = await compute.run(hop, _received(hop.session_id, FrameKind.prefill, 0, hidden))
        assert result.failed_check is None
        assert torch.equal(result.output, expected) is not lies
        if lies:
            assert float(position_errors(result.output, expected).min()) > 0.03
