"""`--quantize auto`, the default: each checkpoint served in the precision it is stored in (a GGUF of 4-bit blocks as
int4, of 5- to 8-bit blocks as int8, floats and safetensors as none), resolved where the checkpoint is read
(hearth/inference/stored_precision.py), and never a label on the wire."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from gguf import GGMLQuantizationType
from pydantic import ValidationError

from hearth.inference import load_head, load_layer_range
from hearth.inference.quantization import QuantizedLinear
from hearth.inference.held_forms import stored_precision, stored_type_precision
from hearth.inference.stored_precision import resolved_head_scheme, resolved_scheme
from hearth.protocol.chat import ChatParams
from hearth.services.common.config import HearthSettings, HostSettings
from hearth.services.devtools.bench.monolithic import MonolithicModel
from hearth.services.host.model_layout import model_layout
from hearth.services.shard.main import load_shard

from .gguf_files import own_cache, tiny_gguf  # noqa: F401  (fixtures)
from .inference_tiny_models import one_torch_thread, write_tiny_model  # noqa: F401  (fixture)

KV = dict(cache_budget_bytes=1 << 24, session_ttl_s=60.0)
CPU = torch.device("cpu")


def _layer(index: int, *matrices: tuple[str, str, int]) -> list[tuple[str, str, list[int]]]:
    return [(f"layers.{index}.{name}", stored, [rows, 64]) for name, stored, rows in matrices]


def test_each_stored_type_maps_to_the_scheme_that_holds_it_without_more_rounding():
    assert [stored_type_precision(t) for t in ("Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K")] == ["int4"] * 5
    assert [stored_type_precision(t) for t in ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")] == ["int8"] * 5
    assert [stored_type_precision(t) for t in ("F32", "F16", "BF16", "F64")] == ["none"] * 4


def test_the_precision_holding_most_of_the_layers_elements_wins_whatever_the_norms_and_the_head():
    # Q4_K_M's heaviest layer: attn_v and ffn_down in Q6_K, the rest in Q4_K.
    q4_k_m = _layer(0, ("q", "Q4_K", 64), ("k", "Q4_K", 16), ("v", "Q6_K", 16), ("o", "Q4_K", 64),
                    ("gate", "Q4_K", 224), ("up", "Q4_K", 224), ("down", "Q6_K", 224))
    norms_and_head = [("layers.0.norm", "F32", [64]), ("lm_head.weight", "F16", [4096, 64]),
                      ("model.embed_tokens.weight", "F32", [4096, 64])]
    assert stored_precision(q4_k_m + norms_and_head) == "int4"
    assert stored_precision(_layer(3, ("q", "Q5_K", 64), ("down", "Q6_K", 224), ("up", "Q4_K", 224))) == "int8"
    assert stored_precision(_layer(0, ("q", "BF16", 64)) + _layer(1, ("q", "F32", 64))) == "none"
    assert stored_precision(_layer(0, ("q", "Q8_0", 64), ("k", "Q4_0", 64))) == "int8"  # a tie: the more precise
    assert stored_precision(norms_and_head) == "none"  # a head's part: no layer to resolve from


def test_a_device_without_the_stored_schemes_kernel_takes_the_next_more_precise_one():
    q4 = _layer(0, ("q", "Q4_0", 64))
    assert resolved_scheme("auto", q4, CPU).label == "int4/g32"
    assert resolved_scheme("auto", q4, "mps").label == "none"  # no quantized kernel there at all
    assert resolved_head_scheme("auto", True, CPU).quantized and not resolved_head_scheme("auto", True, "mps").quantized
    assert not resolved_head_scheme("auto", False, CPU).quantized
    # A scheme named outright is taken as named (quantize_setting checks it against the device).
    assert resolved_scheme("int8", q4, CPU).label == "int8" and resolved_head_scheme("none", True, CPU).label == "none"


@pytest.mark.parametrize(("block_type", "expected"), [
    (GGMLQuantizationType.Q4_1, "int4/g32"), (GGMLQuantizationType.Q8_0, "int8"), (GGMLQuantizationType.F16, "none"),
], ids=["q4_1", "q8_0", "f16"])
def test_a_gguf_range_loads_in_the_scheme_its_blocks_are_stored_in(tiny_gguf, block_type, expected):
    path, _ = tiny_gguf("llama", block_type)
    runner = load_layer_range(path, 0, 1, quantization="auto", **KV)
    named = load_layer_range(path, 0, 1, quantization=expected, **KV)
    in_folder = load_layer_range(path.parent, 0, 1, quantization="auto", **KV)
    try:
        assert runner.quantization == in_folder.quantization == expected
        assert resolved_scheme("auto", str(path), CPU).label == expected  # a path given as text too
        assert runner.weight_bytes == named.weight_bytes  # the same weights as the scheme named outright
    finally:
        for each in (runner, named, in_folder):
            each.close()


def test_a_safetensors_checkpoint_loads_at_full_precision(tmp_path):
    folder = write_tiny_model(tmp_path / "tiny", "llama")
    runner = load_layer_range(folder, 0, 1, quantization="auto", **KV)
    head = load_head(folder, quantization="auto")
    try:
        assert runner.quantization == "none" and type(head._lm_head) is torch.nn.Linear
    finally:
        runner.close()


def test_a_heads_lm_head_is_held_as_its_weight_is_stored(tiny_gguf):
    stored_quantized, _ = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    stored_floats, _ = tiny_gguf("llama", GGMLQuantizationType.F16)
    # Held as under a quantized scheme (float16 where the CPU's half product is fast), not dequantized to float32.
    assert type(load_head(stored_quantized, quantization="auto")._lm_head) is \
        type(load_head(stored_quantized, quantization="int8")._lm_head)
    assert type(load_head(stored_quantized, quantization="auto")._lm_head) is not QuantizedLinear
    assert type(load_head(stored_floats, quantization="auto")._lm_head) is torch.nn.Linear


def test_a_shard_and_a_hosts_plan_under_the_default_serve_a_q4_gguf_as_int4(tiny_gguf, caplog):
    path, _ = tiny_gguf("llama", GGMLQuantizationType.Q4_1)
    settings = HearthSettings()
    assert settings.research.distributed_inference.host.quantize == "auto"
    with caplog.at_level(logging.INFO, logger="hearth.services.shard.main"):
        loaded = asyncio.run(load_shard(model=str(path), lo=0, hi=1, node="n1", settings=settings, model_id=None,
                                        device="cpu", dtype="fp32", stop_event=asyncio.Event()))
    try:
        assert loaded.identity.quantization == "int4/g32" and loaded.identity.shard_id.endswith("+int4/g32@n1")
        assert f"layers 0-1 of {path} served in int4/g32 (--quantize auto: as the checkpoint stores them)" \
            in caplog.messages
    finally:
        loaded.runner.close()
    layout = asyncio.run(model_layout(str(path), model_id=None, compute_dtype=torch.float32, quantize="auto",
                                      nats_url=None, settings=settings))
    assert layout.scheme.label == "int4/g32"


def test_the_bench_baseline_resolves_the_default_as_the_shards_do(tiny_gguf):
    path, _ = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    assert MonolithicModel(path).info.quantization == "int8"


def test_auto_is_a_machines_setting_never_a_requests_scheme():
    assert HostSettings(quantize="auto").quantize == "auto"
    with pytest.raises(ValidationError, match="'auto' names no scheme: expected none, int8, int4 or int4/gN"):
        ChatParams(quantization="auto")
