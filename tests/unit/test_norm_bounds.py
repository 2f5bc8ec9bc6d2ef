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


def test_one_sources_first_frame_of_zeros_does_not_fail_the_others() -> None:
    """Before, one caller's all-zero first frame taught a bound of 0, and every honest frame after it failed `norm`."""
    bounds = NormBounds()
    assert bounds.check(torch.zeros(1, 3, 64), source="attacker") is None
    assert all(bounds.check(honest_step(seed), source=f"honest-{seed}") is None for seed in range(6))
    assert bounds.check(honest_step(9), source="honest-0") is None


def test_no_source_ratchets_the_bound_up_until_corruption_passes() -> None:
    """Before, frames raised 40x a step each passed (under 50x the last) until a 1e4x one did too."""
    bounds = NormBounds()
    for seed in range(3):
        assert bounds.check(honest_step(seed), source=f"honest-{seed}") is None
    scale, failed = 1.0, None
    for _ in range(4):
        scale *= 40.0
        failed = bounds.check(honest_step(5) * scale, source="attacker")
        if failed is not None:
            break
    assert failed == "norm" and scale <= 40.0 ** 3
    assert bounds.check(honest_step(6) * 1e4, source="attacker") == "norm"
    assert bounds.check(honest_step(7), source="honest-1") is None


def test_with_few_sources_each_is_checked_against_its_own_bound_only() -> None:
    bounds = NormBounds()
    assert bounds.check(honest_step(1) * 1e-4, source="quiet") is None
    assert bounds.check(honest_step(2), source="loud") is None  # 1e4x the other source's: its own first frame
    assert bounds.check(honest_step(3) * 1e4, source="loud") == "norm"


def test_many_sources_of_near_zero_frames_do_not_drag_the_median_down() -> None:
    bounds = NormBounds()
    for seed in range(3):
        assert bounds.check(honest_step(seed), source=f"honest-{seed}") is None
    for sybil in range(20):  # pipelines are cheap to open: one member's many near-zero first frames
        assert bounds.check(honest_step(10 + sybil) * 1e-3, source=f"sybil-{sybil}") is None
    assert bounds.check(honest_step(40), source="honest-new") is None
    assert bounds.check(honest_step(41), source="honest-0") is None


def test_a_first_tokens_large_norms_stay_covered_after_many_sources_without_them() -> None:
    """Calls that start from kept prefixes never send position 0, whose norms can be far larger than the rest's: the
    bound must not forget them when such calls make up every recent source."""
    bounds = NormBounds()
    for seed in range(3):
        assert bounds.check(torch.cat([honest_step(seed) * 100.0, honest_step(seed + 50)], dim=1),
                            source=f"fresh-{seed}") is None
    for later in range(80):  # more than the sources remembered
        assert bounds.check(honest_step(100 + later), source=f"kept-prefix-{later}") is None
    assert bounds.check(honest_step(200) * 100.0, source="fresh-again") is None


def test_one_source_alone_does_not_raise_the_shared_bound() -> None:
    """Before, one source's frames just under 50x the bound raised it for everyone: a 2000x corrupted frame from another
    source then passed. The bound rises only to what a second source reached too."""
    bounds = NormBounds()
    for seed in range(3):
        assert bounds.check(honest_step(seed), source=f"honest-{seed}") is None
    assert bounds.check(honest_step(5) * 45.0, source="attacker") is None  # within 50x of the bound: it passes
    assert bounds.check(honest_step(6) * 2000.0, source="honest-1") == "norm"
    assert bounds.check(honest_step(7) * 2000.0, source="attacker") == "norm"


def test_honest_sources_are_never_refused() -> None:
    """No false refusals from learning only what two sources reached: honest sources whose frames differ a few times in
    scale (what they are about), each session beginning with a first token 100x its other positions (as position 0's
    norms run in many models), members joining after the bound is shared, all pass."""
    bounds = NormBounds()
    for round_ in range(6):
        for index, scale in enumerate((0.5, 1.0, 2.0, 3.0, 1.5)[:3 + min(round_, 2)]):
            seed = 100 * round_ + index
            frame = honest_step(seed) * scale
            if round_ % 2 == 0 or index >= 3:  # a fresh session (kept-prefix ones start past position 0)
                frame = torch.cat([honest_step(seed + 50) * scale * 100.0, frame], dim=1)
            assert bounds.check(frame, source=f"member-{index}") is None, (round_, index)
