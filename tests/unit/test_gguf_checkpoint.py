"""GGUF checkpoints load into the same layers as the safetensors checkpoint of the weights they hold; bad files are
refused with one clear line."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM

from hearth.inference import (
    CheckpointError,
    SamplingParams,
    load_full,
    load_head,
    load_layer_range,
    read_config_dict,
    resolve_model_path,
    weights_sha256,
)
from tests.runner_limits import RUNNER_KV_LIMITS
from hearth.inference.gguf_checkpoint import GGUFCheckpoint, gguf_config, gguf_config_dict
from hearth.inference.memory import layer_weight_bytes

from .gguf_files import own_cache, rewrite_gguf, tiny_gguf, write_tiny_gguf  # noqa: F401  (fixtures)
from .inference_tiny_models import TINY_NUM_LAYERS, one_torch_thread  # noqa: F401  (fixture)

PROMPT = "hello there, the quick brown fox"
K_QUANT_ROW = 256
BLOCK_TYPES = [GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0,
               GGMLQuantizationType.Q4_0]


def prefill(runner, head, session_id="s"):
    hidden = runner.forward(session_id, head.embed(head.encode_prompt(PROMPT)), 0, "prefill")
    runner.reset(session_id)
    return hidden


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("block_type", BLOCK_TYPES, ids=lambda t: t.name)
def test_a_layer_range_of_a_gguf_computes_what_its_dequantized_weights_do(tiny_gguf, architecture, block_type):
    path, reference = tiny_gguf(architecture, block_type)
    head = load_head(reference)

    from_gguf = load_layer_range(path, 2, 4, **RUNNER_KV_LIMITS)
    expected = load_layer_range(reference, 2, 4, **RUNNER_KV_LIMITS)

    assert {n for n, _ in from_gguf.named_parameters()} == {n for n, _ in expected.named_parameters()}
    for (name, tensor), (_, want) in zip(from_gguf.named_parameters(), expected.named_parameters()):
        assert torch.equal(tensor, want), name
    assert torch.equal(prefill(from_gguf, head), prefill(expected, head))
    # Only layers 2..4 were read: 3 of the file's 6 layers, and nothing of the embedding or head.
    assert 0 < from_gguf.checkpoint_bytes_read < path.stat().st_size * 3 / TINY_NUM_LAYERS


def test_the_head_of_a_gguf_has_its_tokenizer_chat_template_and_eos(tiny_gguf):
    path, reference = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    expected = load_head(reference)

    head = load_head(path)

    assert head.info.model_id == "tiny" and head.info.path == path.resolve()
    assert head.encode_prompt(PROMPT) == expected.encode_prompt(PROMPT)
    messages = [{"role": "user", "content": "hi"}]
    assert head.encode_chat(messages) == expected.encode_chat(messages)
    assert 2 in head.eos_token_ids
    hidden = torch.randn(1, 3, head.info.hidden_size)
    torch.testing.assert_close(head.logits(hidden), expected.logits(hidden))
    # The head reads embedding, final norm and output only: no layer.
    layers_bytes = sum(t.n_bytes for t in gguf.GGUFReader(path).tensors if t.name.startswith("blk."))
    assert head.checkpoint_bytes_read <= path.stat().st_size - layers_bytes


def test_a_whole_gguf_generates_the_same_greedy_tokens_as_its_dequantized_weights(tiny_gguf):
    path, reference = tiny_gguf("qwen2", GGMLQuantizationType.Q8_0)
    params = SamplingParams(max_tokens=8, stop_token_ids=())
    expected = load_full(reference, **RUNNER_KV_LIMITS)
    model = load_full(path, **RUNNER_KV_LIMITS)
    prompt = expected.head.encode_prompt(PROMPT)
    assert list(model.generate_ids(prompt, params)) == list(expected.generate_ids(prompt, params))


def test_a_folder_holding_one_gguf_resolves_to_it_and_the_checksum_ignores_its_name(tiny_gguf, tmp_path):
    path, _ = tiny_gguf("llama", GGMLQuantizationType.F16)
    folder = tmp_path / "household"
    folder.mkdir()
    copy = shutil.copy(path, folder / "renamed.gguf")

    assert resolve_model_path(folder) == copy.resolve()
    assert weights_sha256(copy, cache_dir=tmp_path) == weights_sha256(path, cache_dir=tmp_path)
    assert read_config_dict(copy)["num_hidden_layers"] == TINY_NUM_LAYERS
    shutil.copy(path, folder / "second.gguf")
    with pytest.raises(CheckpointError, match="several GGUF files"):
        resolve_model_path(folder)


def test_a_folder_holding_a_gguf_beside_a_config_json_is_refused_naming_the_gguf_to_pass(tiny_gguf, tmp_path):
    # As some hub repositories of GGUFs hold a config.json: the folder is then a safetensors checkpoint's.
    path, _ = tiny_gguf("llama", GGMLQuantizationType.F16)
    folder = tmp_path / "downloaded"
    folder.mkdir()
    shutil.copy(path, folder / "model-Q8_0.gguf")
    (folder / "config.json").write_text(json.dumps(gguf_config_dict(path)))

    with pytest.raises(CheckpointError) as refusal:
        load_layer_range(folder, 0, 0, **RUNNER_KV_LIMITS)
    message = str(refusal.value)
    assert "\n" not in message and "has no safetensors weights" in message, message
    assert str(folder / "model-Q8_0.gguf") in message and "only safetensors" not in message, message


def test_memory_planning_counts_a_ggufs_layers_as_they_will_be_held(tiny_gguf):
    path, reference = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    for scheme in ("none", "int8"):
        assert layer_weight_bytes(path, torch.float32, scheme) == layer_weight_bytes(reference, torch.float32, scheme)


def test_a_gguf_of_another_architecture_is_refused_in_one_line(tmp_path):
    path, _ = write_tiny_gguf(tmp_path, "llama", GGMLQuantizationType.F32, with_tokenizer=False,
                              gguf_architecture="gpt2")
    with pytest.raises(CheckpointError) as refused:
        load_layer_range(path, 0, 0, **RUNNER_KV_LIMITS)
    message = str(refused.value)
    assert "\n" not in message and "tiny.gguf" in message and "llama, qwen2" in message


def test_a_truncated_gguf_is_refused_in_one_line(tiny_gguf, tmp_path):
    path, _ = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError) as refused:
        load_layer_range(truncated, 0, 0, **RUNNER_KV_LIMITS)
    assert "\n" not in str(refused.value) and "cut.gguf" in str(refused.value)


def test_a_tensor_in_a_block_type_hearth_does_not_read_is_named(tmp_path, tiny_gguf):
    source, _ = tiny_gguf("llama", GGMLQuantizationType.F32)
    def as_i32(name, values):  # written as GGML I32: not a weight type
        return (values.astype(np.int32) if name == "blk.1.attn_v.weight" else values), None

    path = rewrite_gguf(source, tmp_path / "odd.gguf", "llama", as_i32)

    load_layer_range(path, 0, 0, **RUNNER_KV_LIMITS)  # layer 0 is readable
    with pytest.raises(CheckpointError) as refused:
        load_layer_range(path, 1, 1, **RUNNER_KV_LIMITS)
    message = str(refused.value)
    assert "\n" not in message and "blk.1.attn_v.weight" in message and "I32" in message


def test_a_tensor_stored_as_f64_reads_as_its_values(tmp_path, tiny_gguf):
    """F64 is a plain float type hearth reads; the gguf package has no dequantizer for it, so it is read as is."""
    source, _ = tiny_gguf("llama", GGMLQuantizationType.F32)
    stored = {}

    def as_f64(name, values):
        if name == "blk.1.attn_v.weight":
            stored[name] = values.astype(np.float64)
            return stored[name], None
        return values, None

    path = rewrite_gguf(source, tmp_path / "f64.gguf", "llama", as_f64)
    params = dict(load_layer_range(path, 1, 1, **RUNNER_KV_LIMITS).named_parameters())
    v_proj = next(v for k, v in params.items() if k.endswith("1.self_attn.v_proj.weight"))
    assert torch.equal(v_proj, torch.from_numpy(stored["blk.1.attn_v.weight"]).to(v_proj.dtype))


def test_a_gguf_lacking_a_layers_tensor_is_refused_in_one_line(tmp_path, tiny_gguf):
    source, _ = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(tmp_path / "holed.gguf"), "llama")
    for key, field in reader.fields.items():
        if key.startswith("llama.") or key == "tokenizer.ggml.eos_token_id":
            writer.add_key_value(key, field.contents(), field.types[0])
    for tensor in reader.tensors:
        if tensor.name != "blk.1.ffn_up.weight":
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    load_layer_range(tmp_path / "holed.gguf", 0, 0, **RUNNER_KV_LIMITS)  # layer 0 is whole
    with pytest.raises(CheckpointError) as refused:
        load_layer_range(tmp_path / "holed.gguf", 1, 1, **RUNNER_KV_LIMITS, quantization="int4/g32")
    message = str(refused.value)
    assert "\n" not in message and "holed.gguf" in message and "model.layers.1.mlp.up_proj.weight" in message


def test_k_quant_tensors_read_as_the_gguf_package_dequantizes_them(tmp_path, tiny_gguf):
    # gguf.quants cannot write K-quants: store random Q4_K / Q6_K blocks with finite scales and compare. Their
    # 256-wide blocks need rows that long: the down projections' with this intermediate size.
    source, _ = tiny_gguf("qwen2", GGMLQuantizationType.F32, intermediate_size=K_QUANT_ROW)
    rng = np.random.default_rng(0)
    block_types = {"blk.0.ffn_down.weight": GGMLQuantizationType.Q4_K,
                   "blk.1.ffn_down.weight": GGMLQuantizationType.Q6_K}
    expected = {}

    def random_k_blocks(name, values):
        if name not in block_types:
            return values, None
        block_type = block_types[name]
        blocks = rng.integers(0, 256, gguf.quants.quant_shape_to_byte_shape(values.shape, block_type), dtype=np.uint8)
        blocks = _finite_scales(blocks, block_type)
        expected[name] = gguf.quants.dequantize(blocks, block_type)
        return blocks, block_type

    path = rewrite_gguf(source, tmp_path / "kquants.gguf", "qwen2", random_k_blocks)

    params = dict(load_layer_range(path, 0, 1, **RUNNER_KV_LIMITS).named_parameters())
    for layer in (0, 1):
        down = next(v for k, v in params.items() if k.endswith(f"{layer}.mlp.down_proj.weight"))
        assert torch.equal(down, torch.from_numpy(expected[f"blk.{layer}.ffn_down.weight"]))


def _finite_scales(blocks: np.ndarray, block_type: GGMLQuantizationType) -> np.ndarray:
    """Random blocks with their float16 super-block scales set to small finite values."""
    block_bytes = gguf.GGML_QUANT_SIZES[block_type][1]
    per_block = blocks.reshape(-1, block_bytes)
    # Q4_K keeps d and dmin (two float16) first; Q6_K keeps d (one float16) last.
    scale_bytes = slice(0, 4) if block_type == GGMLQuantizationType.Q4_K else slice(block_bytes - 2, block_bytes)
    count = (scale_bytes.stop - scale_bytes.start) // 2
    scales = np.full((per_block.shape[0], count), 0.01, dtype=np.float16)
    per_block[:, scale_bytes] = scales.view(np.uint8)
    return per_block.reshape(blocks.shape)


def test_a_head_without_tokenizer_still_knows_the_ggufs_eos(tiny_gguf):
    path, _ = tiny_gguf("llama", GGMLQuantizationType.F32, with_tokenizer=False)
    head = load_head(path, load_tokenizer=False)
    assert not head.has_tokenizer and head.eos_token_ids == {2}


def test_gguf_checkpoint_reports_missing_tensors_by_hf_name(tiny_gguf):
    path, _ = tiny_gguf("llama", GGMLQuantizationType.F32)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(gguf_config(path))
    checkpoint = GGUFCheckpoint(path, skeleton)
    assert "model.layers.0.self_attn.q_proj.weight" in checkpoint
    with pytest.raises(CheckpointError, match="model.layers.99.mlp.up_proj.weight"):
        checkpoint.read(["model.layers.99.mlp.up_proj.weight"], torch.float32)


async def test_the_orchestrators_catalog_serves_a_gguf_under_its_stem_with_its_context_length(
        tiny_gguf, tmp_path, monkeypatch):
    from hearth.services.orchestrator.catalog import ModelCatalog

    monkeypatch.setenv("HEARTH_CACHE_DIR", str(tmp_path))

    path, _ = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    catalog = ModelCatalog(local_model=str(path.parent))  # the folder holding the one GGUF

    loaded = await catalog.get(str(path))

    assert catalog.local_model_id() == loaded.model_id == "tiny"
    assert loaded.context_length == read_config_dict(path)["max_position_embeddings"]
    assert loaded.weights_sha256 == weights_sha256(path)
