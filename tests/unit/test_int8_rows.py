"""int8 on the CPU with activations quantized per row (hearth/inference/int8_kernels.py): a row's product never depends
on its batch, the two levels keep it as close to the int8 weights' product as bfloat16 activations do, the packed form
holds the very codes of per-row int8, Linears reading one input share one product, and a torch without the operator
keeps the weight-only kernel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hearth.inference import int8_kernels, quantization
from hearth.inference.int8_kernels import fbgemm_row_product, fbgemm_shared_product, int8_rows_on_cpu, pack_for_fbgemm
from hearth.inference.weight_codes import int8_per_channel
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
    expected_codes, _ = int8_per_channel(dense.weight.detach())
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
def test_linears_reading_one_input_share_one_product_and_give_what_each_gives_alone():
    """q, k and v (and gate and up) run on one packed product: the same numbers as each Linear's own, contiguous,
    whatever member comes first; the product is let go once every member took its part."""
    torch.manual_seed(4)
    attention = nn.Module()
    attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj = (
        nn.Linear(IN_FEATURES, width, bias=width == 64) for width in (OUT_FEATURES, 64, 64, IN_FEATURES))
    alone = {name: QuantizedLinear(getattr(attention, name), parse_quantization("int8"))
             for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert quantization.quantize_linears(attention, parse_quantization("int8")) == 4
    shared = attention.q_proj._shared[0]
    assert attention.k_proj._shared[0] is shared and attention.v_proj._shared[0] is shared
    assert attention.o_proj._shared is None and attention.o_proj._fbgemm_packed is not None
    assert sum(held.packed_bytes for held in (attention.q_proj, attention.k_proj, attention.v_proj)) \
        == (OUT_FEATURES + 64 + 64) * IN_FEATURES
    rows = heavy_tailed_rows(5).reshape(1, 5, IN_FEATURES)
    with torch.inference_mode():
        for order in (("q_proj", "k_proj", "v_proj"), ("v_proj", "q_proj", "k_proj")):
            for name in order:
                ours = getattr(attention, name)(rows)
                assert ours.is_contiguous() and torch.equal(ours, alone[name](rows))
            assert getattr(shared._kept, "entry", None) is None


@needs_fbgemm
def test_a_shared_input_changed_in_place_is_computed_again():
    codes, scales = int8_weights(3)
    packed = pack_for_fbgemm(codes, scales)
    shared = fbgemm_shared_product(torch.cat([codes, codes[:64]]), torch.cat([scales, scales[:64]]),
                                   [OUT_FEATURES, 64])
    rows = heavy_tailed_rows(2)
    before = shared.columns(0, rows)
    assert torch.equal(before, fbgemm_row_product(rows, packed))
    rows[1] *= -3
    changed = shared.columns(1, rows)
    assert torch.equal(changed, fbgemm_row_product(rows, packed)[:, :64])
    assert not torch.equal(changed[1], before[1, :64])


@needs_fbgemm
def test_linears_reading_one_input_are_packed_once_together_and_none_alone_first(monkeypatch):
    packed_rows: list[int] = []
    pack = int8_kernels.pack_for_fbgemm

    def counted(codes, scales):
        packed_rows.append(codes.shape[0])
        return pack(codes, scales)

    monkeypatch.setattr(int8_kernels, "pack_for_fbgemm", counted)
    monkeypatch.setattr(quantization, "pack_for_fbgemm", counted)
    attention = nn.Module()
    attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj = (
        nn.Linear(IN_FEATURES, width) for width in (OUT_FEATURES, 64, 64, IN_FEATURES))
    quantization.quantize_linears(attention, parse_quantization("int8"))
    assert sorted(packed_rows) == sorted([OUT_FEATURES + 64 + 64, IN_FEATURES])


def test_codes_left_unpacked_are_refused_rather_than_multiplied():
    held = QuantizedLinear(nn.Linear(IN_FEATURES, OUT_FEATURES), parse_quantization("int8"), pack=False)
    if int8_rows_on_cpu():
        with pytest.raises(quantization.QuantizationError, match="left unpacked"):
            held(torch.zeros(1, IN_FEATURES))
        held.pack_codes()
    assert held(torch.zeros(1, IN_FEATURES)).shape == (1, OUT_FEATURES)
