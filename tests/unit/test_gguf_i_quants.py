"""A GGUF whose layers are stored in I-quants (IQ4_NL, IQ4_XS: 4-bit indices into an uneven 16-level codebook, as
llama.cpp writes them for small 4-bit files; IQ3, IQ2 and IQ1: indices into grids of a few levels, for large models
in little memory) loads, its values exactly as the gguf package dequantizes them, and is served in int4 by default:
the codebooks' levels are no int4 groups, so int4 rounds them again."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from hearth.inference import load_layer_range
from hearth.inference.memory import layer_weight_bytes, range_weight_bytes, weights_held_as_stored
from hearth.inference.quantization import parse_quantization
from hearth.inference.stored_precision import checkpoint_precision, resolved_scheme
from tests.runner_limits import RUNNER_KV_LIMITS

from .gguf_files import IQ4_NL_LEVELS, own_cache, quantized_iq4_nl, rewrite_gguf, tiny_gguf  # noqa: F401
from .test_gguf_stored_int4 import held_linears

IQ4_NL, IQ4_XS = GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS
SUPER_BLOCK = 256
LOWER_BIT_I_QUANTS = [GGMLQuantizationType[name] for name in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S",
                                                                "IQ3_XXS", "IQ3_S")]
SMALL_D = np.float16(1e-4).view(np.uint16)


def random_blocks(values: np.ndarray, block_type: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Random `block_type` blocks for a matrix of `values`' shape (gguf.quants cannot write I-quants), each super-
    block's float16 d small, so that every value is finite."""
    shape = gguf.quants.quant_shape_to_byte_shape(values.shape, block_type)
    blocks = rng.integers(0, 256, shape, dtype=np.uint8)
    per_block = blocks.reshape(-1, gguf.GGML_QUANT_SIZES[block_type][1])
    if block_type == GGMLQuantizationType.IQ1_M:  # its d is spread over the top nibbles of its four scale words
        scales = per_block[:, -8:].copy().view(np.uint16)
        for index in range(4):
            nibble = np.uint16((int(SMALL_D) >> (4 * index)) & 0xF)
            scales[:, index] = (scales[:, index] & np.uint16(0x0FFF)) | np.uint16(nibble << 12)
        per_block[:, -8:] = scales.view(np.uint8)
    else:  # d leads every other block
        per_block[:, 0:2] = np.full((len(per_block), 1), SMALL_D, dtype=np.uint16).view(np.uint8)
    return blocks


def i_quant_file(source, path, down_type: GGMLQuantizationType):
    """`source` (the tiny llama in float32) with its layer matrices in IQ4_NL, ffn_down (256 inputs: one super-block
    a row) in `down_type`."""
    rng = np.random.default_rng(0)

    def i_quants(name: str, values: np.ndarray):
        if values.ndim != 2 or not name.startswith("blk."):
            return values, None
        if name.endswith("ffn_down.weight"):
            return random_blocks(values, down_type, rng), down_type
        return quantized_iq4_nl(values), IQ4_NL

    return rewrite_gguf(source, path, "llama", i_quants)


@pytest.fixture
def float_source(tiny_gguf):
    return tiny_gguf("llama", GGMLQuantizationType.F32, intermediate_size=SUPER_BLOCK)[0]


@pytest.fixture
def i_quant_gguf(float_source, tmp_path):
    return i_quant_file(float_source, tmp_path / "iq4.gguf", IQ4_XS)


def test_an_iq4_nl_block_written_for_the_tests_reads_back_to_its_nearest_levels():
    values = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    back = gguf.quants.dequantize(quantized_iq4_nl(values), IQ4_NL)
    d = np.abs(values).reshape(-1, 32).max(axis=1, keepdims=True) / -IQ4_NL_LEVELS[0]
    widest_step = np.diff(IQ4_NL_LEVELS).max()
    assert (np.abs(back - values).reshape(-1, 32) <= 1.01 * d * widest_step / 2).all()


def test_layers_in_4_bit_i_quants_load_as_the_gguf_package_dequantizes_them(i_quant_gguf):
    runner = load_layer_range(i_quant_gguf, 0, 1, quantization="none", **RUNNER_KV_LIMITS)
    reader = gguf.GGUFReader(i_quant_gguf)
    stored = {tensor.name: tensor for tensor in reader.tensors}
    for hf_name, gguf_name in (("self_attn.v_proj", "blk.1.attn_v.weight"), ("mlp.down_proj", "blk.1.ffn_down.weight")):
        tensor = stored[gguf_name]
        expected = torch.from_numpy(gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type))
        assert torch.equal(runner._stack.layers[1].get_submodule(hf_name).weight, expected), gguf_name
    hidden = torch.randn(1, 4, runner.info.hidden_size)
    assert bool(torch.isfinite(runner.forward("s", hidden, 0, "prefill")).all())


def test_a_4_bit_i_quant_file_is_served_in_int4_by_default_rounded_again(i_quant_gguf):
    assert checkpoint_precision(i_quant_gguf) == "int4"
    assert resolved_scheme("auto", i_quant_gguf, "cpu") == parse_quantization("int4/g32")
    runner = load_layer_range(i_quant_gguf, 0, 1, quantization="auto", **RUNNER_KV_LIMITS)
    assert runner.quantization == "int4/g32"
    assert {linear.scheme for linear in held_linears(runner).values()} == {parse_quantization("int4/g32")}
    assert weights_held_as_stored(i_quant_gguf, "int4/g32", device="cpu") == {}  # no int4 groups to hold as stored
    assert range_weight_bytes(layer_weight_bytes(i_quant_gguf, torch.float32, "int4/g32"), 0, 1) == runner.weight_bytes


@pytest.mark.parametrize("down_type", LOWER_BIT_I_QUANTS, ids=lambda block_type: block_type.name)
def test_lower_bit_i_quants_load_as_the_gguf_package_dequantizes_them_and_serve_in_int4(float_source, tmp_path,
                                                                                       down_type):
    path = i_quant_file(float_source, tmp_path / f"{down_type.name}.gguf", down_type)
    runner = load_layer_range(path, 1, 1, quantization="none", **RUNNER_KV_LIMITS)
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_down.weight")
    expected = torch.from_numpy(gguf.quants.dequantize(np.array(tensor.data), down_type))
    assert bool(torch.isfinite(expected).all())
    assert torch.equal(runner._stack.layers[1].mlp.down_proj.weight, expected)
    served = load_layer_range(path, 1, 1, quantization="auto", **RUNNER_KV_LIMITS)
    assert served.quantization == "int4/g32"
    assert held_linears(served)["model.layers.1.mlp.down_proj.weight"].scheme == parse_quantization("int4/g32")
