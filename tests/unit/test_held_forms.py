"""What each layer matrix is held in given how a GGUF stores it (hearth/inference/held_forms.py): under int4, a
4-bit mix's more precise matrices (llama.cpp's Q4_K_M keeps attn_v and ffn_down of some layers in Q6_K or Q8_0) are
held in int8, as int8 holds them, instead of being rounded to 4 bits; where a layer is mostly 5- to 8-bit int4 rounds
every matrix as asked."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from hearth.inference import load_layer_range
from hearth.inference.held_forms import KEPT_PRECISE_SCHEME, held_scheme, kept_precise, layer_precisions
from hearth.inference.memory import layer_weight_bytes, range_weight_bytes, weights_kept_precise, \
    weights_rounded_again
from hearth.inference.quantization import QuantizationError, QuantizationScheme, parse_quantization
from hearth.services.devtools.bench.eval_options import EvalOptions
from hearth.services.devtools.bench.quality import evaluate, format_eval_report
from tests.runner_limits import RUNNER_KV_LIMITS

from .gguf_files import own_cache, q4_k_m_like, quantized_q6_k, rewrite_gguf, tiny_gguf  # noqa: F401  (fixtures)
from .inference_tiny_models import TINY_NUM_LAYERS, one_torch_thread  # noqa: F401  (fixture)
from .test_gguf_stored_int4 import held_linears

INT4_G32, INT8 = parse_quantization("int4/g32"), parse_quantization("int8")
MORE_BITS_LAYER = 1
Q6_K_ROW = 256


@pytest.fixture
def mix_and_source(tiny_gguf, tmp_path):
    """(a Q4_K_M-like mix of the tiny llama, the float32 GGUF it was made from)."""
    source, _ = tiny_gguf("llama", GGMLQuantizationType.F32, intermediate_size=Q6_K_ROW)
    return q4_k_m_like(source, tmp_path / "mix.gguf", more_bits_layers=(MORE_BITS_LAYER,)), source


@pytest.fixture
def mixed_gguf(mix_and_source):
    return mix_and_source[0]


def test_a_q6_k_block_written_for_the_tests_reads_back_within_its_rounding():
    values = np.random.default_rng(0).standard_normal((4, 2 * Q6_K_ROW)).astype(np.float32)
    values[1] = 0  # a zero super-block stays zero, finite
    back = gguf.quants.dequantize(quantized_q6_k(values), GGMLQuantizationType.Q6_K)
    assert back.shape == values.shape and np.isfinite(back).all() and not back[1].any()
    # each sub-block of 16: a step of its largest magnitude / 32 (then the int8 scale's own rounding): within a step
    steps = np.abs(values).reshape(4, -1, 16).max(axis=2, keepdims=True) / 32
    assert (np.abs(back - values).reshape(4, -1, 16) <= 1.01 * steps).all()


@pytest.mark.parametrize(("scheme", "stored_type", "layer_precision", "held"), [
    ("int4/g32", "Q6_K", "int4", KEPT_PRECISE_SCHEME),  # a 4-bit mix's more precise matrix
    ("int4/g64", "Q8_0", "int4", KEPT_PRECISE_SCHEME),
    ("int4/g32", "Q5_K", "int4", KEPT_PRECISE_SCHEME),
    ("int4/g32", "Q6_K", "int8", None),  # a layer mostly of 5 to 8 bits: int4 rounds it, as asked
    ("int4/g32", "F16", "int4", None),  # floats follow the scheme
    ("int8", "Q6_K", "int4", None),  # int8 holds it in int8 anyway
    ("none", "Q6_K", "int4", None),
])
def test_which_matrices_a_scheme_keeps_in_int8(scheme, stored_type, layer_precision, held):
    assert kept_precise(parse_quantization(scheme), stored_type, layer_precision) == held
    assert held_scheme(parse_quantization(scheme), stored_type, (64, 256), layer_precision, "cpu") == held


def test_4_bit_groups_are_held_as_stored_before_any_mix_rule():
    assert held_scheme(INT4_G32, "Q4_1", (64, 256), "int4", "cpu") == INT4_G32
    assert held_scheme(INT8, "Q4_0", (64, 256), "int4", "cpu") == INT4_G32
    assert held_scheme(INT4_G32, "Q4_1", (256,), "int4", "cpu") is None  # a vector is held dense


def test_each_layer_has_its_own_stored_precision():
    tensors = [("model.layers.0.q.weight", "Q4_K", [64, 64]), ("model.layers.0.down.weight", "Q6_K", [64, 32]),
               ("model.layers.1.q.weight", "Q8_0", [64, 64]), ("model.layers.1.down.weight", "Q4_K", [64, 32]),
               ("model.layers.1.norm.weight", "F32", [64]), ("lm_head.weight", "Q6_K", [100, 64])]
    assert layer_precisions(tensors) == {0: "int4", 1: "int8"}


def test_int4_holds_a_mixs_more_precise_matrices_in_int8_as_int8_does(mixed_gguf):
    under_int4 = load_layer_range(mixed_gguf, 0, 2, quantization="int4/g32", **RUNNER_KV_LIMITS)
    under_int8 = load_layer_range(mixed_gguf, 0, 2, quantization="int8", **RUNNER_KV_LIMITS)
    held = {name: linear.scheme for name, linear in held_linears(under_int4).items()}
    kept = {f"model.layers.{MORE_BITS_LAYER}.{name}.weight" for name in ("self_attn.v_proj", "mlp.down_proj")}
    assert {name for name, scheme in held.items() if scheme == INT8} == kept
    assert {scheme for name, scheme in held.items() if name not in kept} == {INT4_G32}  # the Q4_1 ones as stored
    assert under_int4.quantization == "int4/g32"  # the label stays the scheme asked for
    # Every matrix is held alike under both schemes: the same logits bit for bit, the same bytes.
    torch.manual_seed(0)
    hidden = torch.randn(1, 5, under_int4.info.hidden_size)
    assert torch.equal(under_int4.forward("a", hidden, 0, "prefill"), under_int8.forward("a", hidden, 0, "prefill"))
    assert under_int4.weight_bytes == under_int8.weight_bytes
    assert range_weight_bytes(layer_weight_bytes(mixed_gguf, torch.float32, "int4/g32"), 0, 2) == \
        under_int4.weight_bytes
    assert weights_kept_precise(mixed_gguf, "int4/g32") == {"Q6_K": 1, "Q8_0": 1}
    assert weights_kept_precise(mixed_gguf, "int8") == {}


def test_a_range_without_the_more_precise_layer_holds_its_layers_as_the_whole_file_does(mixed_gguf):
    alone = held_linears(load_layer_range(mixed_gguf, 2, 2, quantization="int4/g32", **RUNNER_KV_LIMITS))
    assert {linear.scheme for linear in alone.values()} == {INT4_G32}
    kept = held_linears(load_layer_range(mixed_gguf, 1, 1, quantization="int4/g32", **RUNNER_KV_LIMITS))
    assert sum(linear.scheme == INT8 for linear in kept.values()) == 2


def test_int4_rounds_every_matrix_of_a_file_mostly_in_more_bits(tiny_gguf):
    path, _ = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    runner = load_layer_range(path, 1, 2, quantization="int4/g32", **RUNNER_KV_LIMITS)
    assert {linear.scheme for linear in held_linears(runner).values()} == {QuantizationScheme("int4", 32)}
    assert weights_kept_precise(path, "int4/g32") == {}


def test_eval_says_int4_keeps_a_mixs_more_precise_blocks_and_agrees_with_int8_on_them(mixed_gguf, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 8)
    report = evaluate(EvalOptions(text=text, model=str(mixed_gguf), schemes=("int8", "int4/g32"),
                                  context_tokens=16, max_tokens=32))
    int8, int4 = report.schemes
    assert int8.kept_precise is None and int4.kept_precise is not None
    assert int4.kept_precise.weights == {"Q6_K": 1, "Q8_0": 1} and int4.kept_precise.held_in == "int8"
    assert (int4.mean_kl_nats, int4.top1_agreement) == (int8.mean_kl_nats, int8.top1_agreement)
    said = [line for line in format_eval_report(report).splitlines() if "more precise blocks" in line]
    assert said == ["int4/g32: keeps the 4-bit mix's more precise blocks in int8 (1 Q6_K, 1 Q8_0 layer weights), as "
                    "int8 does, rather than rounding them to 4 bits"]
    # int8 rounds the 6- and 8-bit blocks again into its rows, int4/g32 no block (the rest held as stored).
    assert int8.rounded_again == {"Q6_K": 1, "Q8_0": 1} and int4.rounded_again is None


def test_what_each_scheme_rounds_again_of_a_gguf(mixed_gguf, tiny_gguf):
    matrices = 7 * TINY_NUM_LAYERS  # q, k, v, o, gate, up and down of each layer
    assert weights_rounded_again(mixed_gguf, "int4/g32") == {}
    # int4 of another group rounds the stored 4-bit groups again; the mix's precise ones stay in int8
    assert weights_rounded_again(mixed_gguf, "int4/g64") == {"Q4_1": matrices - 2}
    assert weights_rounded_again(mixed_gguf, "none") == {}
    q8_0, _ = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    assert weights_rounded_again(q8_0, "int4/g32") == {"Q8_0": matrices}
    float_file, _ = tiny_gguf("llama", GGMLQuantizationType.F32)
    assert weights_rounded_again(float_file, "int4/g32") == {}



def test_a_matrix_held_in_int8_needs_no_int4_shape(tiny_gguf, tmp_path):
    # ffn_down reads 96 inputs (no multiple of int4/g64's group) and is stored in Q8_0 in a layer of Q4_1 matrices:
    # int4/g64 holds it in int8, so its shape is no reason to refuse the range; in Q4_1 like the others it would be.
    source, _ = tiny_gguf("llama", GGMLQuantizationType.F32, intermediate_size=96)

    def down_in_q8_0(down_type):
        def mixed(name, values):
            if values.ndim != 2 or not name.startswith("blk."):
                return values, None
            block_type = down_type if ".ffn_down." in name else GGMLQuantizationType.Q4_1
            return gguf.quants.quantize(values, block_type), block_type
        return mixed

    mix = rewrite_gguf(source, tmp_path / "mix.gguf", "llama", down_in_q8_0(GGMLQuantizationType.Q8_0))
    runner = load_layer_range(mix, 0, 1, quantization="int4/g64", **RUNNER_KV_LIMITS)
    held = {name: linear.scheme for name, linear in held_linears(runner).items()}
    assert {scheme for name, scheme in held.items() if "down_proj" in name} == {INT8}
    assert {scheme for name, scheme in held.items() if "down_proj" not in name} == {parse_quantization("int4/g64")}
    all_q4_1 = rewrite_gguf(source, tmp_path / "q4_1.gguf", "llama", down_in_q8_0(GGMLQuantizationType.Q4_1))
    with pytest.raises(QuantizationError, match="down_proj has 96 input features"):
        load_layer_range(all_q4_1, 0, 1, quantization="int4/g64", **RUNNER_KV_LIMITS)
