"""int8 on the CPU with activations quantized per row (hearth/inference/int8_kernels.py): a row's product never depends
on its batch, the two levels keep it as close to the int8 weights' product as bfloat16 activations do, the packed form
holds the very codes of per-row int8, and a torch without the operator keeps the weight-only kernel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hearth.inference import quantization
from hearth.inference.int8_kernels import fbgemm_row_product, int8_rows_on_cpu, pack_for_fbgemm
from hearth.inference.quantization import QuantizedLinear, parse_quantization

needs_fbgemm = pytest.mark.skipif(not int8_rows_on_cpu(), reason="this torch has no fbgemm int8 product")

IN_FEATURES, OUT_FEATURES = 256, 192
# Relative error against the product of the int8 weights themselves: bfloat16's rounding of the activations is
# about 0.002; one 7-bit level alone gives about 0.015.
TWO_LEVEL_ERROR_BOUND = 0.005


def int8_weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    weight = torch.randn(OUT_FEATURES, IN_FEATURES) * 0.02
    scales = weight.abs().amax(dim=1) / 127
    return torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def fbgemm_codes(packed) -> torch.Tensor:
    """The int8 codes [out, in] a packed weight holds."""
    weight, _bias = torch.ops.quantized.linear_unpack(packed)
    return weight.int_repr()


def heavy_tailed_rows(count: int) -> torch.Tensor:
    """Rows with a few large entries, as a down projection's inputs have."""
    rows = torch.randn(count, IN_FEATURES)
    rows[:, ::37] *= 30
    return rows


@needs_fbgemm
def test_each_row_is_computed_alone_whatever_its_batch():
    codes, scales = int8_weights()
    packed = pack_for_fbgemm(codes, scales)
    rows = heavy_tailed_rows(300)
    rows[7] *= 1e4  # a row far larger than the others: a scale shared by the batch would crush them
    together = fbgemm_row_product(rows, packed)
    for first, count in [(0, 1), (7, 1), (3, 2), (5, 17), (100, 64), (250, 50)]:
        assert torch.equal(fbgemm_row_product(rows[first:first + count], packed), together[first:first + count])


@needs_fbgemm
def test_two_levels_are_as_close_as_bfloat16_activations():
    codes, scales = int8_weights(1)
    rows = heavy_tailed_rows(64)
    exact = rows.double() @ (codes.double() * scales.double()[:, None]).t()
    ours = fbgemm_row_product(rows, pack_for_fbgemm(codes, scales))
    assert float((ours.double() - exact).norm() / exact.norm()) < TWO_LEVEL_ERROR_BOUND


@needs_fbgemm
def test_zero_rows_give_zeros():
    codes, scales = int8_weights(2)
    assert torch.equal(fbgemm_row_product(torch.zeros(3, IN_FEATURES), pack_for_fbgemm(codes, scales)),
                       torch.zeros(3, OUT_FEATURES))


@needs_fbgemm
def test_the_packed_form_holds_per_row_int8_codes_and_leaves_the_engine_as_it_was():
    engine = torch.backends.quantized.engine
    dense = nn.Linear(IN_FEATURES, OUT_FEATURES, bias=False)
    held = QuantizedLinear(dense, parse_quantization("int8"))
    assert torch.backends.quantized.engine == engine
    expected_codes, _ = quantization._int8_per_channel(dense.weight.detach())
    assert torch.equal(fbgemm_codes(held._fbgemm_packed), expected_codes)
    assert "weight_int8" not in dict(held.named_buffers())
    assert held.packed_bytes == OUT_FEATURES * IN_FEATURES
    assert quantization.held_tensor_bytes([held]) == OUT_FEATURES * IN_FEATURES + 2 * OUT_FEATURES


def test_without_the_operator_int8_keeps_the_weight_only_kernel(monkeypatch):
    monkeypatch.setattr(quantization, "int8_rows_on_cpu", lambda: False)
    dense = nn.Linear(IN_FEATURES, OUT_FEATURES)
    held = QuantizedLinear(dense, parse_quantization("int8"))
    assert held._fbgemm_packed is None and held.packed_bytes == 0
    assert held.weight_int8.dtype == torch.int8
    inputs = torch.randn(4, IN_FEATURES)
    with torch.inference_mode():
        reference = dense(inputs)
        assert float((held(inputs) - reference).norm() / reference.norm()) < 0.01


@needs_fbgemm
def test_an_input_changed_in_place_is_quantized_again():
    """Levels are kept for the next product of the same input (q, k and v read one): never for changed values."""
    codes, scales = int8_weights(3)
    packed = pack_for_fbgemm(codes, scales)
    rows = heavy_tailed_rows(2).bfloat16()
    before = fbgemm_row_product(rows, packed)
    assert torch.equal(fbgemm_row_product(rows, packed), before)
    rows[1] *= -3
    changed = fbgemm_row_product(rows, packed)
    assert torch.equal(changed[0], before[0]) and not torch.equal(changed[1], before[1])
    assert torch.equal(changed, fbgemm_row_product(rows.clone(), packed_again := pack_for_fbgemm(codes, scales)))
    assert torch.equal(fbgemm_row_product(rows.float(), packed_again), changed)
