"""NormBounds: the per-activation sanity check every hop and the orchestrator's sink run on each step."""

import torch

from hearth.services.transport.integrity import NormBounds


def honest_step(seed: int) -> torch.Tensor:
    return torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(seed))


def test_honest_steps_pass_and_teach_the_bound() -> None:
    bounds = NormBounds()
    assert all(bounds.check(honest_step(seed)) is None for seed in range(5))
    assert bounds.max_norm is not None and 4.0 < bounds.max_norm < 20.0


def test_nan_and_inf_are_told_apart() -> None:
    for poison, expected in ((float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "inf")):
        bounds = NormBounds()
        corrupted = honest_step(0)
        corrupted[0, 1, 7] = poison
        assert bounds.check(corrupted) == expected
        assert bounds.max_norm is None, "a failing frame must not move the bound"


def test_a_scaled_frame_fails_the_norm_check_once_a_bound_is_known() -> None:
    bounds = NormBounds()
    assert bounds.check(honest_step(1) * 1e4) is None, "nothing is known before the first frame"
    bounds = NormBounds()
    assert bounds.check(honest_step(1)) is None
    assert bounds.check(honest_step(2) * 1e4) == "norm"
    assert bounds.check(honest_step(3)) is None


def test_half_precision_frames_are_checked_in_float32() -> None:
    bounds = NormBounds()
    assert bounds.check(honest_step(4).to(torch.bfloat16)) is None
    corrupted = honest_step(5).to(torch.float16)
    corrupted[0, 0, 0] = float("nan")
    assert bounds.check(corrupted) == "nan"


def test_an_empty_frame_passes_without_teaching_a_zero_bound() -> None:
    bounds = NormBounds()
    assert bounds.check(torch.empty(1, 0, 64)) is None
    assert bounds.max_norm is None
    assert bounds.check(honest_step(6)) is None
