"""On the CPU a layer's Linears rounded from float weights (int8; int4 without cached codes; a 4-bit mix's more
precise matrices in int8) are rounded from the checkpoint's rows a chunk at a time (hearth/inference/loading.py
weight_rows): the same products as rounding each weight read whole, and no Linear weight is read whole, so a
quantized load never holds a layer in floats."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file, save_file
from torch import nn

from hearth.inference import load_layer_range, weight_codes
from hearth.inference.checkpoint import SafetensorsCheckpoint
from hearth.inference.errors import CheckpointError
from hearth.inference.gguf_checkpoint import GGUFCheckpoint
from hearth.inference.loading import open_skeleton
from hearth.inference.quantization import QuantizedLinear, parse_quantization
from tests.runner_limits import RUNNER_KV_LIMITS

from .gguf_files import own_cache, q4_k_m_like, tiny_gguf  # noqa: F401  (fixtures)
from .inference_tiny_models import tiny_model_dir, write_tiny_model  # noqa: F401  (fixture)
from .test_gguf_stored_int4 import held_linears
from .test_head_from_rows import whole_reads_of

LO, HI = 0, 1
Q6_K_ROW = 256


def whole_weight_products(path, linears: dict[str, QuantizedLinear], dtype) -> dict[str, nn.Module]:
    """For each loaded Linear, the same scheme rounded from its weight (and bias) read whole, as `read` gives it."""
    skeleton = open_skeleton(path, dtype=dtype, device=None, attn_implementation=None, model_id=None, revision=None,
                             cache_dir=None, local_files_only=None)
    references = {}
    for name, linear in linears.items():
        bias_name = name.removesuffix(".weight") + ".bias"
        names = [name, bias_name] if bias_name in skeleton.checkpoint.names() else [name]
        tensors = skeleton.checkpoint.read(names, skeleton.info.dtype)
        dense = nn.Linear(linear.in_features, linear.out_features, bias=len(names) == 2)
        dense.weight.data = tensors[name]
        if dense.bias is not None:
            dense.bias.data = tensors[bias_name]
        references[name] = QuantizedLinear(dense, linear.scheme)
    return references


def checkpoint(kind: str, tiny_model_dir, tiny_gguf, tmp_path):
    if kind in ("safetensors-llama", "safetensors-llama-bf16"):
        return tiny_model_dir("llama")
    if kind == "safetensors-sharded":
        return tiny_model_dir("llama", max_shard_size="100KB")
    if kind == "safetensors-qwen2":  # biases on q, k and v
        return tiny_model_dir("qwen2")
    if kind == "gguf-f16":  # Q and K rows stored in llama.cpp's rotary order
        return tiny_gguf("llama", GGMLQuantizationType.F16)[0]
    if kind == "gguf-q8_0":
        return tiny_gguf("llama", GGMLQuantizationType.Q8_0)[0]
    if kind.startswith("gguf-f16-"):  # the other architectures' tensor processors
        return tiny_gguf(kind.removeprefix("gguf-f16-"), GGMLQuantizationType.F16)[0]
    source, _ = tiny_gguf("llama", GGMLQuantizationType.F32, intermediate_size=Q6_K_ROW)
    return q4_k_m_like(source, tmp_path / "mix.gguf", more_bits_layers=(LO, HI))  # attn_v Q8_0, ffn_down Q6_K


@pytest.mark.parametrize(("kind", "scheme"), [
    *((kind, scheme) for kind in ("safetensors-llama", "safetensors-llama-bf16", "safetensors-sharded",
                                  "safetensors-qwen2", "gguf-f16", "gguf-q8_0", "gguf-mix")
      for scheme in ("int8", "int4/g32")),
    *((f"gguf-f16-{architecture}", "int8") for architecture in ("qwen2", "qwen3", "phi3", "gemma2", "gemma3"))])
def test_linears_rounded_from_rows_are_those_rounded_from_the_whole_weight(kind, scheme, tiny_model_dir, tiny_gguf,
                                                                          tmp_path, monkeypatch):
    path = checkpoint(kind, tiny_model_dir, tiny_gguf, tmp_path)
    # Chunks of 32 rows: every weight comes in several (Q's permuted rows among them).
    monkeypatch.setattr(weight_codes, "QUANTIZE_ROWS_PER_CHUNK", weight_codes.INT4_PACK_ROWS)
    whole_reads = whole_reads_of(GGUFCheckpoint if kind.startswith("gguf") else SafetensorsCheckpoint, monkeypatch)

    dtype = torch.bfloat16 if kind.endswith("bf16") else None  # rows rounded to the dtype first, as a read is
    runner = load_layer_range(path, LO, HI, dtype=dtype, quantization=scheme, **RUNNER_KV_LIMITS)

    linears = held_linears(runner)
    from_floats = {name for name, linear in linears.items()
                   if linear.scheme.kind == "int8" or kind != "gguf-mix"}  # the mix's 4-bit blocks are held as stored
    assert len(linears) == (4 if kind.endswith("phi3") else 7) * (HI - LO + 1) and from_floats
    assert not from_floats & set(whole_reads), "a Linear rounded from floats was read whole"
    dense = load_layer_range(path, LO, HI, dtype=dtype, quantization="none", **RUNNER_KV_LIMITS)
    assert runner.checkpoint_bytes_read == dense.checkpoint_bytes_read  # every weight's rows read, and counted
    if kind == "gguf-mix":
        assert {linear.scheme for name, linear in linears.items() if name in from_floats} == {
            parse_quantization("int8")}
        assert len(from_floats) == 2 * (HI - LO + 1)
    references = whole_weight_products(path, {name: linears[name] for name in from_floats}, dtype)
    torch.manual_seed(0)
    for name in sorted(from_floats):
        rows = torch.randn(3, linears[name].in_features)
        assert torch.equal(linears[name](rows), references[name](rows)), name


@pytest.mark.parametrize(("sizes", "said"), [([32, 16], "did not come as one chunk"), ([64, 32], "more rows came")])
def test_a_weight_whose_rows_do_not_come_as_the_chunks_asked_is_refused(sizes, said):
    chunks = iter([torch.zeros(size, 64) for size in sizes])
    with pytest.raises(ValueError, match=said):
        weight_codes.int4_codes_of_rows((64, 64), 32, chunks)


def test_int4_codes_of_rows_are_the_whole_weights():
    torch.manual_seed(1)
    weight = torch.randn(2 * weight_codes.QUANTIZE_ROWS_PER_CHUNK + 3 * weight_codes.INT4_PACK_ROWS, 64)
    chunks = weight.split(weight_codes.rows_per_chunk(weight.shape[0]))
    assert len(chunks) == 3
    chunked = weight_codes.int4_codes_of_rows(tuple(weight.shape), 32, iter(chunks))
    whole = weight_codes.packed_int4_codes(  # each row range rounded from the whole weight
        tuple(weight.shape), 32, lambda first, last: weight_codes.int4_grouped_codes(weight[first:last], 32))
    assert torch.equal(chunked.packed_codes, whole.packed_codes)
    assert torch.equal(chunked.scales_and_zeros, whole.scales_and_zeros)


@pytest.mark.parametrize("scheme", ["int8", "int4/g32"])
def test_a_weight_of_another_shape_is_refused_in_one_line_before_its_rows_are_read(tmp_path, scheme):
    folder = write_tiny_model(tmp_path / "tiny", "llama", with_tokenizer=False)
    weights = folder / "model.safetensors"
    stored = load_file(weights)
    name = "model.layers.0.mlp.up_proj.weight"
    expected = tuple(stored[name].shape)
    stored[name] = stored[name][:, :32].contiguous()
    save_file(stored, str(weights), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as refusal:
        load_layer_range(folder, 0, 0, quantization=scheme, **RUNNER_KV_LIMITS)
    assert str(refusal.value) == (f"the checkpoint's {name} is ({expected[0]}, 32), where the model's config makes "
                                  f"it {expected}")
