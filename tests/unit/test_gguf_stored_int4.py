"""A GGUF's Linear weights stored as 4-bit codes in groups of 32 (Q4_0, Q4_1, Q4_K) are never re-rounded into more
bits: under int8, or int4 of their group, a shard holds them in int4 of the stored groups, codes as stored; other
storage follows the scheme, and int4 of another group keeps its group."""

from __future__ import annotations

import asyncio

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hearth.inference import load_layer_range, weight_codes
from hearth.inference.gguf_checkpoint import GGUFCheckpoint, gguf_config
from hearth.inference.memory import layer_weight_bytes, range_weight_bytes
from hearth.inference.quantization import QuantizationScheme, QuantizedLinear
from hearth.services.common.config import HearthSettings
from hearth.services.common.config_processes import ShardSettings
from hearth.services.host.model_layout import model_layout
from hearth.services.shard.memory_plan import estimated_need
from tests.runner_limits import RUNNER_KV_LIMITS

from .gguf_files import own_cache, rewrite_gguf, tiny_gguf, write_tiny_gguf  # noqa: F401  (fixtures)
from .inference_tiny_models import one_torch_thread  # noqa: F401  (fixture)
from .test_batched_decode import decode_eight_sessions_together

STORED_INT4 = QuantizationScheme("int4", 32)
INT8 = QuantizationScheme("int8")
K_QUANT_ROW = 256
LO, HI = 1, 2
# The kernel holds each group's scale and zero in bfloat16 (8 significant bits) and rounds its product to bfloat16:
# a held weight w = (code - 8) * scale + zero is off by at most about 2^-9 of |w| + 8 |scale| + |zero|; allow 2^-8.
BFLOAT16_ROUNDING = 2.0 ** -8


def open_checkpoint(path) -> GGUFCheckpoint:
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(gguf_config(path))
    return GGUFCheckpoint(path, skeleton)


def held_linears(runner) -> dict[str, QuantizedLinear]:
    """The range's quantized Linears by the checkpoint name of their weight."""
    return {f"model.layers.{index}.{name}.weight": module
            for index, layer in runner._stack.layers.items()
            for name, module in layer.named_modules() if isinstance(module, QuantizedLinear)}


def weight_seen_by_kernel(linear: QuantizedLinear) -> torch.Tensor:
    """The weight a quantized Linear multiplies by, as its products on unit rows show it."""
    columns = linear(torch.eye(linear.in_features)).t()
    return columns if linear.bias is None else columns - linear.bias[:, None]


def bfloat16_bound(groups) -> torch.Tensor:
    """Per element: how far the int4 kernel may hold a weight from its stored value (BFLOAT16_ROUNDING)."""
    scales = groups.scales.repeat_interleave(groups.group_size, dim=1)
    zeros = (groups.minimums + 8 * groups.scales).repeat_interleave(groups.group_size, dim=1)
    return BFLOAT16_ROUNDING * (groups.dequantized().abs() + 8 * scales.abs() + zeros.abs())


@pytest.mark.parametrize("block_type", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1], ids=lambda t: t.name)
def test_4_bit_blocks_read_as_codes_stand_for_exactly_the_ggufs_dequantized_values(tiny_gguf, block_type):
    path, _ = tiny_gguf("llama", block_type)
    checkpoint = open_checkpoint(path)
    # q_proj and k_proj rows are stored in llama.cpp's rotary order: their codes must come back in HF's.
    names = [f"model.layers.1.{part}.weight" for part in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj")]
    for name in names:
        groups = checkpoint.read_int4_groups(name)
        assert checkpoint.stored_int4_group_size(name) == 32
        assert groups.group_size == 32 and int(groups.codes.max()) <= 15 and groups.codes.dtype == torch.uint8
        assert torch.equal(groups.dequantized(), checkpoint.read([name], torch.float32)[name]), name
    assert checkpoint.stored_int4_group_size("model.layers.1.input_layernorm.weight") is None


def assert_packed_a_chunk_at_a_time_as_whole(checkpoint: GGUFCheckpoint, names: list[str]) -> None:
    """read_int4_codes (rows read and packed a chunk at a time, several chunks here) gives the very buffers of the
    whole weight's codes packed at once."""
    for name in names:
        whole, chunked = checkpoint.read_int4_groups(name).packed_for_cpu(), checkpoint.read_int4_codes(name)
        assert torch.equal(chunked.packed_codes, whole.packed_codes), name
        assert torch.equal(chunked.scales_and_zeros, whole.scales_and_zeros), name


@pytest.mark.parametrize("architecture,block_type", [
    ("llama", GGMLQuantizationType.Q4_0), ("llama", GGMLQuantizationType.Q4_1), ("qwen2", GGMLQuantizationType.Q4_1),
], ids=lambda value: getattr(value, "name", value))
def test_codes_packed_a_chunk_of_rows_at_a_time_are_those_of_the_whole_weight(tiny_gguf, monkeypatch, architecture,
                                                                               block_type):
    monkeypatch.setattr(weight_codes, "QUANTIZE_ROWS_PER_CHUNK", weight_codes.INT4_PACK_ROWS)
    path, _ = tiny_gguf(architecture, block_type)
    checkpoint = open_checkpoint(path)
    # q_proj's rows are stored in llama.cpp's rotary order: a chunk's rows are gathered from across the file's.
    names = [f"model.layers.1.{part}.weight" for part in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj")]
    assert all(checkpoint._stored(name).shape[0] > weight_codes.INT4_PACK_ROWS for name in names)
    assert_packed_a_chunk_at_a_time_as_whole(checkpoint, names)


def test_q4_k_sub_blocks_are_groups_of_32_standing_for_exactly_the_ggufs_values(tmp_path, tiny_gguf, monkeypatch):
    # gguf.quants cannot write K-quants: random Q4_K blocks (finite scales) on the 256-wide down projection rows.
    source, _ = tiny_gguf("llama", GGMLQuantizationType.F32, intermediate_size=K_QUANT_ROW)
    rng = np.random.default_rng(0)

    def random_q4_k(name, values):
        if name != "blk.1.ffn_down.weight":
            return values, None
        shape = gguf.quants.quant_shape_to_byte_shape(values.shape, GGMLQuantizationType.Q4_K)
        blocks = rng.integers(0, 256, shape, dtype=np.uint8)
        per_block = blocks.reshape(-1, gguf.GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K][1])
        per_block[:, 0:4] = np.full((len(per_block), 2), 0.01, dtype=np.float16).view(np.uint8)  # d, dmin
        return blocks, GGMLQuantizationType.Q4_K

    path = rewrite_gguf(source, tmp_path / "q4k.gguf", "llama", random_q4_k)
    checkpoint = open_checkpoint(path)
    name = "model.layers.1.mlp.down_proj.weight"
    groups = checkpoint.read_int4_groups(name)
    assert checkpoint.stored_int4_group_size(name) == groups.group_size == 32
    assert torch.equal(groups.dequantized(), checkpoint.read([name], torch.float32)[name])
    monkeypatch.setattr(weight_codes, "QUANTIZE_ROWS_PER_CHUNK", weight_codes.INT4_PACK_ROWS)
    assert_packed_a_chunk_at_a_time_as_whole(checkpoint, [name])

    runner = load_layer_range(path, 1, 1, quantization="int8", **RUNNER_KV_LIMITS)
    held = held_linears(runner)
    assert held[name].scheme == STORED_INT4
    assert held["model.layers.1.mlp.up_proj.weight"].scheme == QuantizationScheme("int8")  # stored F32


@pytest.mark.parametrize("scheme", ["int8", "int4/g32"])
@pytest.mark.parametrize("architecture,block_type", [
    ("llama", GGMLQuantizationType.Q4_0), ("llama", GGMLQuantizationType.Q4_1), ("qwen2", GGMLQuantizationType.Q4_1),
], ids=lambda value: getattr(value, "name", value))
def test_linears_stored_in_4_bit_groups_are_held_as_stored_in_int4_of_those_groups(tiny_gguf, architecture,
                                                                                    block_type, scheme):
    path, reference = tiny_gguf(architecture, block_type)
    stored_values = load_file(reference / "model.safetensors")
    checkpoint = open_checkpoint(path)

    runner = load_layer_range(path, LO, HI, quantization=scheme, **RUNNER_KV_LIMITS)

    assert runner.quantization == scheme  # the scheme asked stays the shard's label
    held = held_linears(runner)
    assert len(held) == 7 * (HI - LO + 1)
    int8_beyond_bound = False
    for name, linear in held.items():
        assert linear.scheme == STORED_INT4, name
        stored = stored_values[name]
        bound = bfloat16_bound(checkpoint.read_int4_groups(name))
        assert bool(((weight_seen_by_kernel(linear) - stored).abs() <= bound).all()), name
        # Per-row int8 of the same values re-rounds every one of them onto its own grid: not as close.
        dense = torch.nn.Linear(stored.shape[1], stored.shape[0], bias=False)
        dense.weight.data = stored.clone()
        int8 = QuantizedLinear(dense, QuantizationScheme("int8"))
        int8_beyond_bound |= bool(((weight_seen_by_kernel(int8) - stored).abs() > bound).any())
    assert int8_beyond_bound
    # Memory figures count what is held.
    assert range_weight_bytes(layer_weight_bytes(path, torch.float32, scheme), LO, HI) == runner.weight_bytes


@pytest.mark.parametrize("block_type", [GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0], ids=lambda t: t.name)
def test_linears_stored_otherwise_follow_int8(tiny_gguf, block_type):
    path, _ = tiny_gguf("llama", block_type)
    runner = load_layer_range(path, LO, HI, quantization="int8", **RUNNER_KV_LIMITS)
    assert {linear.scheme for linear in held_linears(runner).values()} == {QuantizationScheme("int8")}
    assert range_weight_bytes(layer_weight_bytes(path, torch.float32, "int8"), LO, HI) == runner.weight_bytes


def test_int4_of_another_group_keeps_the_group_asked_for(tiny_gguf):
    path, _ = tiny_gguf("llama", GGMLQuantizationType.Q4_1)
    runner = load_layer_range(path, LO, HI, quantization="int4/g64", **RUNNER_KV_LIMITS)
    assert {linear.scheme for linear in held_linears(runner).values()} == {QuantizationScheme("int4", 64)}


def test_full_precision_keeps_a_q4_ggufs_linears_dense(tiny_gguf):
    path, _ = tiny_gguf("llama", GGMLQuantizationType.Q4_1)
    runner = load_layer_range(path, LO, HI, **RUNNER_KV_LIMITS)
    assert not held_linears(runner)


def test_batched_decode_of_a_q4_gguf_under_int8_gives_each_session_its_solo_tokens(tiny_gguf):
    path, _ = tiny_gguf("llama", GGMLQuantizationType.Q4_1)
    batch, expected = decode_eight_sessions_together(path, quantization="int8")
    assert batch.tokens == expected
    assert batch.runners[0]._batched and batch.runners[0].quantization == "int8"
    assert {linear.scheme for linear in held_linears(batch.runners[0]).values()} == {STORED_INT4}


def test_two_hosts_loading_the_same_q4_gguf_under_int8_hold_the_same_weights(tiny_gguf, tmp_path):
    # Failover moves a session to a replica of the same file and scheme: its weights must be the very same.
    path, _ = tiny_gguf("qwen2", GGMLQuantizationType.Q4_0)
    copy = tmp_path / "elsewhere.gguf"
    copy.write_bytes(path.read_bytes())
    first, second = (held_linears(load_layer_range(p, LO, HI, quantization="int8", **RUNNER_KV_LIMITS))
                     for p in (path, copy))
    assert first.keys() == second.keys()
    for name, linear in first.items():
        theirs = second[name].state_dict()
        assert all(torch.equal(tensor, theirs[key]) for key, tensor in linear.state_dict().items()), name


def test_hosts_and_shards_plan_with_the_device_that_will_hold_the_layers(tiny_gguf):
    """4-bit groups are held as stored only where the device has the int4 kernel: elsewhere the plan counts int8."""
    path, _ = tiny_gguf("llama", GGMLQuantizationType.Q4_1)
    on = {device: asyncio.run(model_layout(str(path), model_id=None, compute_dtype=torch.float32, quantize=INT8,
                                           nats_url=None, settings=HearthSettings(), device=device)).layer_bytes
          for device in ("cpu", "mps")}
    assert all(cpu < elsewhere for cpu, elsewhere in zip(on["cpu"], on["mps"], strict=True))
    assert on["mps"] == [layer_weight_bytes(path, torch.float32, INT8, device="mps")[index]
                         for index in range(len(on["mps"]))]
    needs = {device: estimated_need(path, LO, HI, torch.float32, ShardSettings(), INT8, device).weight_bytes
             for device in ("cpu", "mps")}
    assert needs["cpu"] == sum(on["cpu"][LO:HI + 1]) < needs["mps"] == sum(on["mps"][LO:HI + 1])
