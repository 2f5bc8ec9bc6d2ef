"""Quantized shard weights: scheme parsing and labels, a quantized Linear's error, quantized ranges chained equal to
the whole quantized model, their memory, and greedy agreement with full precision."""

from __future__ import annotations

import gguf
import pytest
import torch
from torch import nn

from hearth.inference import (
    DEFAULT_QUANTIZATION,
    InferenceError,
    QuantizationError,
    QuantizationScheme,
    SamplingParams,
    load_full,
    load_head,
    load_layer_range,
    parse_quantization,
)
from tests.runner_limits import RUNNER_KV_LIMITS
from hearth.inference import weight_codes
from hearth.inference.memory import layer_weight_bytes, range_weight_bytes
from hearth.inference.weight_codes import INT4_MIDPOINT, int4_grouped_codes
from hearth.inference.quantization import (
    DEFAULT_INT4_GROUP_SIZE, QuantizedLinear, check_device_supports, quantize_linears,
)

from .inference_tiny_models import (  # noqa: F401  (fixtures are used by name)
    TINY_NUM_LAYERS,
    one_torch_thread,
    tiny_model_dir,
    write_tiny_model,
)
from .test_batched_decode import decode_eight_sessions_together
from .test_inference_parity import run_pipeline

PROMPT = "hello there, the quick brown fox"
DECODE_STEPS = 12
SCHEMES = ("int8", "int4/g32", "int4/g64")
# Bounds on a quantized Linear's relative output error against float32 (random uniform weights, random inputs).
RELATIVE_ERROR_BOUND = {"int8": 0.01, "int4/g32": 0.1, "int4/g64": 0.12}
# Bytes a quantized range may hold relative to float32 (the shard targets).
TYPICAL_INIT_STD = 0.02
BFLOAT16_ERROR_BOUND = 0.01
WEIGHT_RATIO_BOUND = {"int8": 0.35, "int4/g32": 0.22, "int4/g64": 0.22}


@pytest.mark.parametrize("text,label", [
    ("none", "none"), ("int8", "int8"),
    ("int4", f"int4/g{DEFAULT_INT4_GROUP_SIZE}"), ("int4/g128", "int4/g128"), (None, "none"),
])
def test_parse_gives_the_canonical_label(text, label):
    scheme = parse_quantization(text)
    assert scheme.label == label == str(scheme)
    assert parse_quantization(scheme.label) == scheme
    assert parse_quantization(scheme) is scheme


def test_the_default_is_full_precision():
    assert parse_quantization(DEFAULT_QUANTIZATION) == QuantizationScheme() and not QuantizationScheme().quantized


@pytest.mark.parametrize("text", ["int3", "fp8", "", "int8/g32", "int4/g33", "int4/g0", "int4/64", "none/g32",
                                  "INT8", " int4/g32 ", "int8\n"])  # exact, as labels travel on the wire
def test_bad_schemes_are_refused_in_one_line(text):
    with pytest.raises(QuantizationError) as caught:
        parse_quantization(text)
    assert isinstance(caught.value, InferenceError)
    message = str(caught.value)
    assert message and "\n" not in message


@pytest.mark.parametrize("label", SCHEMES)
def test_a_scheme_on_a_device_without_kernels_is_refused(label):
    with pytest.raises(QuantizationError, match=f"{label} has no kernel on mps"):
        check_device_supports(parse_quantization(label), "mps")
    check_device_supports(parse_quantization("none"), "mps")
    check_device_supports(parse_quantization(label), "cpu")


def test_a_group_size_that_does_not_divide_a_layer_is_refused_before_reading(tiny_model_dir):
    with pytest.raises(QuantizationError, match="not a multiple of int4/g128's group size"):
        load_layer_range(tiny_model_dir("llama"), 0, 0, quantization="int4/g128", **RUNNER_KV_LIMITS)


@pytest.mark.parametrize("label", SCHEMES)
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_a_quantized_linear_is_close_to_float32(label, rows):
    torch.manual_seed(0)
    dense = nn.Linear(256, 192)
    inputs = torch.randn(2, rows, 256)
    quantized = QuantizedLinear(dense, parse_quantization(label))
    with torch.inference_mode():
        reference, ours = dense(inputs), quantized(inputs)
    assert ours.shape == reference.shape and ours.dtype == torch.float32
    assert float((ours - reference).norm() / reference.norm()) < RELATIVE_ERROR_BOUND[label]
    assert set(dict(quantized.named_buffers())) >= {"bias"} and not list(quantized.parameters())


@pytest.mark.parametrize("group_size", [32, 64])
def test_the_int4_kernel_computes_with_the_dequantized_weights(group_size):
    """Its error is bfloat16's alone, beside the weights' codes, scales and zeros."""
    torch.manual_seed(1)
    dense = nn.Linear(128, 96, bias=False)
    codes, scales_and_zeros = int4_grouped_codes(dense.weight.detach(), group_size)
    dequantized = _dequantized(codes, scales_and_zeros, group_size)
    inputs = torch.randn(5, 128)
    with torch.inference_mode():
        ours = QuantizedLinear(dense, QuantizationScheme("int4", group_size))(inputs)
    reference = inputs @ dequantized.t()
    assert float((ours - reference).norm() / reference.norm()) < BFLOAT16_ERROR_BOUND


def _dequantized(codes: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The weights torch's int4 kernels compute with: (code - 8) · scale + zero, per group."""
    rows, columns = codes.shape
    scales, zeros = (scales_and_zeros[..., part].t().float().unsqueeze(2) for part in (0, 1))
    grouped = codes.float().reshape(rows, columns // group_size, group_size)
    return ((grouped - INT4_MIDPOINT) * scales + zeros).reshape(rows, columns)


def _min_max_rounding(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each group's values rounded to 16 even steps from its minimum to its maximum (with the same bfloat16 scale and
    zero)."""
    rows, columns = weight.shape
    grouped = weight.reshape(rows, columns // group_size, group_size)
    low, high = grouped.amin(dim=2, keepdim=True), grouped.amax(dim=2, keepdim=True)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny).to(torch.bfloat16).float()
    zero = (low + 8 * scale).to(torch.bfloat16).float()
    codes = torch.round((grouped - zero) / scale + 8).clamp(0, 15)
    return ((codes - 8) * scale + zero).reshape(rows, columns)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("values", ["normal", "heavy_tailed", "constant_groups", "iq4_levels"])
def test_int4_rounds_each_group_at_least_as_close_as_its_minimum_to_maximum_steps(group_size, values):
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 256, generator=generator)
    if values == "heavy_tailed":  # a few outliers a row, as trained weights have
        weight = weight * torch.rand(64, 256, generator=generator).pow(8).mul(20).add(1)
    elif values == "constant_groups":
        weight[:8] = 0.25
        weight[8:16] = 0
    elif values == "iq4_levels":  # an IQ4_NL block's 16 uneven levels times its scale, as a GGUF is read
        levels = torch.tensor(gguf.quants.IQ4_NL.kvalues, dtype=torch.float32)
        picks = torch.randint(0, 16, (64, 256), generator=generator)
        weight = levels[picks] * torch.rand(64, 256 // 32, 1, generator=generator).repeat_interleave(32, 1).squeeze(2)
    codes, scales_and_zeros = int4_grouped_codes(weight, group_size)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert scales_and_zeros.shape == (256 // group_size, 64, 2)
    ours = _dequantized(codes, scales_and_zeros, group_size)
    assert torch.isfinite(ours).all()
    groups_error = (ours - weight).pow(2).reshape(64, -1, group_size).sum(dim=2)
    min_max_error = (_min_max_rounding(weight, group_size) - weight).pow(2).reshape(64, -1, group_size).sum(dim=2)
    # Never further than the even steps of minimum..maximum (but for bfloat16's rounding of the fitted scale and
    # zero), and closer on the whole: a range searched and fitted, not the values' extremes.
    assert (groups_error <= min_max_error * 1.01 + 1e-12).all()
    if values == "constant_groups":
        assert torch.equal(ours[:16], weight[:16])
    else:
        assert float(groups_error.sum()) < 0.95 * float(min_max_error.sum())


def test_quantize_linears_keeps_no_dense_weight():
    layer = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Sequential(nn.Linear(64, 32, bias=False)))
    assert quantize_linears(layer, parse_quantization("int8")) == 2
    assert not any(type(module) is nn.Linear for module in layer.modules())
    assert {name for name, _ in layer.named_parameters()} == {"1.weight", "1.bias"}
    assert quantize_linears(layer, parse_quantization("none")) == 0


@pytest.mark.parametrize("label", SCHEMES)
def test_quantized_ranges_chained_equal_the_whole_quantized_model(tiny_model_dir, label):
    path = tiny_model_dir("llama")
    local = load_full(path, quantization=label, **RUNNER_KV_LIMITS)
    assert local.runner.quantization == parse_quantization(label).label
    prompt_ids = local.head.encode_prompt(PROMPT)
    middle = TINY_NUM_LAYERS // 2
    hops = [(load_layer_range(path, 0, middle - 1, quantization=label, **RUNNER_KV_LIMITS), None),
            (load_layer_range(path, middle, TINY_NUM_LAYERS - 1, quantization=label, **RUNNER_KV_LIMITS), None)]
    whole_tokens, whole_logits = run_pipeline(local.head, [(local.runner, None)], prompt_ids, DECODE_STEPS)
    tokens, logits = run_pipeline(local.head, hops, prompt_ids, DECODE_STEPS)
    assert tokens == whole_tokens
    for step, (ours, theirs) in enumerate(zip(logits, whole_logits, strict=True)):
        assert torch.equal(ours, theirs), f"logits differ at step {step}"


@pytest.mark.parametrize("label", SCHEMES)
def test_a_quantized_range_holds_a_fraction_of_the_float32_bytes_and_the_estimate_matches(tiny_model_dir, label):
    path = tiny_model_dir("llama")
    dense = load_layer_range(path, 0, 2, **RUNNER_KV_LIMITS)
    quantized = load_layer_range(path, 0, 2, quantization=label, **RUNNER_KV_LIMITS)
    assert dense.quantization == "none"
    assert quantized.weight_bytes <= WEIGHT_RATIO_BOUND[label] * dense.weight_bytes
    assert range_weight_bytes(layer_weight_bytes(path, torch.float32, label), 0, 2) == quantized.weight_bytes
    assert range_weight_bytes(layer_weight_bytes(path, torch.float32), 0, 2) == dense.weight_bytes


@pytest.mark.parametrize("label,min_agreement", [("int8", 0.8), ("int4/g32", 0.5)])
def test_quantized_greedy_tokens_mostly_agree_with_full_precision(tmp_path, label, min_agreement):
    """Teacher-forced on full precision's own greedy tokens, so one early difference does not derail the rest. With
    transformers' usual initialisation: the parity models' larger one makes a random model too chaotic for int4."""
    path = write_tiny_model(tmp_path / "llama", "llama", initializer_range=TYPICAL_INIT_STD)
    dense, quantized = load_full(path, **RUNNER_KV_LIMITS), load_full(path, quantization=label, **RUNNER_KV_LIMITS)
    prompt_ids = dense.head.encode_prompt(PROMPT)
    reference = list(dense.generate_ids(prompt_ids, SamplingParams(temperature=0.0, max_tokens=40)))
    sequence = torch.tensor(prompt_ids + reference[:-1])
    agreements = []
    for model in (dense, quantized):
        hidden = model.runner.forward("teacher", model.head.embed(sequence.tolist()), 0, "prefill")
        predictions = [model.head.sample(model.head.logits(hidden[:, : position + 1]), SamplingParams(temperature=0.0))
                       for position in range(len(prompt_ids) - 1, len(sequence))]
        agreements.append(predictions)
    assert agreements[0] == reference
    matches = sum(a == b for a, b in zip(agreements[0], agreements[1], strict=True))
    assert matches >= min_agreement * len(reference)


@pytest.mark.parametrize("label", SCHEMES)
def test_quantizing_in_row_chunks_gives_the_same_buffers_as_all_rows_at_once(label, monkeypatch):
    torch.manual_seed(2)
    dense = nn.Linear(128, 320)
    chunked = QuantizedLinear(dense, parse_quantization(label))
    monkeypatch.setattr(weight_codes, "QUANTIZE_ROWS_PER_CHUNK", 10**6)
    whole = QuantizedLinear(dense, parse_quantization(label))
    for (name, ours), (_, theirs) in zip(chunked.named_buffers(), whole.named_buffers(), strict=True):
        assert torch.equal(ours, theirs), name


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])  # qwen3's tiny model ties lm_head to the embedding
def test_a_quantized_head_holds_lm_head_in_int8_and_its_batched_logits_equal_one_row_logits(tiny_model_dir,
                                                                                          architecture):
    path = tiny_model_dir(architecture)
    dense, quantized = load_head(path), load_head(path, quantization="int4/g32")
    assert isinstance(quantized._lm_head, QuantizedLinear) and quantized._lm_head.scheme.label == "int8"
    if dense.info.tie_word_embeddings:  # the embedding stays: the int8 lm_head is a copy beside it
        assert dense.weight_bytes < quantized.weight_bytes <= 1.3 * dense.weight_bytes
    else:
        assert quantized.weight_bytes < dense.weight_bytes
    torch.manual_seed(3)
    states = [torch.randn(1, length, dense.info.hidden_size) for length in (1, 3, 2, 5)]
    logits, bounds = quantized.batch_logits(states)
    for row, hidden in enumerate(states):
        assert torch.equal(logits[row], quantized.logits(hidden))
        reference = dense.logits(hidden)
        assert float((logits[row] - reference).norm() / reference.norm()) < RELATIVE_ERROR_BOUND["int8"]
    assert bool((bounds >= 0).all())


@pytest.mark.parametrize("label", ["int8", "int4/g32"])
def test_batched_decode_steps_of_quantized_ranges_give_each_session_its_solo_tokens(tiny_model_dir, label):
    batch, expected = decode_eight_sessions_together(tiny_model_dir("llama"), quantization=label)
    assert batch.tokens == expected
    assert batch.runners[0]._batched and batch.runners[0].quantization == label
