"""Loading reads only the tensors a part needs, resolves hub ids offline, refuses unsupported families."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import GPT2Config, GPT2LMHeadModel

from hearth.inference import (
    CheckpointError,
    UnsupportedArchitectureError,
    load_head,
    load_layer_range,
    resolve_model_path,
    supported_architectures,
)
from tests.runner_limits import RUNNER_KV_LIMITS

from .inference_tiny_models import one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)

SIXTEEN_LAYERS = 16
FP32_BYTES = 4  # the tiny checkpoints are saved in float32


def tensor_sizes(path) -> dict[str, int]:
    """Byte size of every tensor in a checkpoint, read from the safetensors headers."""
    sizes = {}
    for file in path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                tensor_slice = handle.get_slice(name)
                numel = 1
                for dim in tensor_slice.get_shape():
                    numel *= dim
                assert tensor_slice.get_dtype() == "F32"
                sizes[name] = numel * FP32_BYTES
    return sizes


@pytest.mark.parametrize("layout", ["single_file", "sharded"])
def test_a_quarter_of_the_layers_reads_and_holds_a_quarter_of_the_layer_weights(tiny_model_dir, layout):
    extra = {"max_shard_size": "100KB"} if layout == "sharded" else {}
    path = tiny_model_dir("llama", num_hidden_layers=SIXTEEN_LAYERS, **extra)
    sizes = tensor_sizes(path)
    layer_bytes = sum(size for name, size in sizes.items() if name.startswith("model.layers."))
    wanted = {name for name in sizes if any(name.startswith(f"model.layers.{i}.") for i in range(4, 8))}

    runner = load_layer_range(path, 4, 7, **RUNNER_KV_LIMITS)

    assert set(runner.loaded_tensor_names) == wanted
    assert {name for name, _ in runner.named_parameters()} == wanted
    assert runner.checkpoint_bytes_read == sum(sizes[name] for name in wanted)
    assert runner.weight_bytes == runner.checkpoint_bytes_read == layer_bytes // 4
    assert (runner.layer_lo, runner.layer_hi, runner.num_layers) == (4, 7, 4)
    assert not any(t.is_meta for _, t in runner.named_parameters())


def test_head_reads_only_embedding_final_norm_and_lm_head(tiny_model_dir):
    path = tiny_model_dir("llama")
    sizes = tensor_sizes(path)
    head = load_head(path)
    expected = sizes["model.embed_tokens.weight"] + sizes["model.norm.weight"] + sizes["lm_head.weight"]
    assert head.checkpoint_bytes_read == head.weight_bytes == expected


def test_head_with_tied_embeddings_shares_one_matrix(tiny_model_dir):
    path = tiny_model_dir("qwen3")  # tie_word_embeddings=True: the checkpoint has no lm_head.weight
    sizes = tensor_sizes(path)
    assert "lm_head.weight" not in sizes
    head = load_head(path)
    assert head.info.tie_word_embeddings
    assert head.checkpoint_bytes_read == head.weight_bytes
    assert head.weight_bytes == sizes["model.embed_tokens.weight"] + sizes["model.norm.weight"]
    hidden = head.embed([5, 6, 7])
    assert head.logits(hidden).shape == (head.info.vocab_size,)


def test_model_info_describes_the_checkpoint(tiny_model_dir):
    path = tiny_model_dir("gemma2")
    runner = load_layer_range(path, 2, 3, model_id="tiny/gemma2", **RUNNER_KV_LIMITS)
    info = runner.info
    assert (info.model_id, info.architecture, info.model_type) == (
        "tiny/gemma2",
        "Gemma2ForCausalLM",
        "gemma2",
    )
    assert (info.num_layers, info.hidden_size, info.dtype, info.dtype_name) == (
        6,
        64,
        torch.float32,
        "float32",
    )
    assert load_layer_range(path, 0, 0, **RUNNER_KV_LIMITS).info.model_id == path.name


def test_dtype_override_converts_weights_and_activations(tiny_model_dir):
    path = tiny_model_dir("llama")
    runner = load_layer_range(path, 0, 1, dtype="bfloat16", **RUNNER_KV_LIMITS)
    head = load_head(path, dtype=torch.bfloat16)
    assert runner.info.dtype == torch.bfloat16
    assert {t.dtype for _, t in runner.named_parameters()} == {torch.bfloat16}
    hidden = runner.forward("s", head.embed([1, 2, 3]), 0, "prefill")
    assert hidden.dtype == torch.bfloat16
    assert head.logits(hidden).dtype == torch.float32


@pytest.mark.parametrize("lo,hi", [(-1, 2), (3, 2), (0, 6)])
def test_layer_range_outside_the_model_is_refused(tiny_model_dir, lo, hi):
    with pytest.raises(ValueError, match="not inside 0-5"):
        load_layer_range(tiny_model_dir("llama"), lo, hi, **RUNNER_KV_LIMITS)


def test_unsupported_architecture_fails_at_load_naming_it_and_the_supported_ones(tmp_path):
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    for load in (lambda: load_layer_range(tmp_path, 0, 1, **RUNNER_KV_LIMITS), lambda: load_head(tmp_path)):
        with pytest.raises(UnsupportedArchitectureError) as error:
            load()
        message = str(error.value)
        assert "GPT2LMHeadModel" in message
        for supported in supported_architectures():
            assert supported in message


def test_unknown_model_type_is_refused_before_transformers_parses_it(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "frobnicator", "architectures": ["FrobLM"]})
    )
    with pytest.raises(UnsupportedArchitectureError, match="FrobLM.*LlamaForCausalLM"):
        load_layer_range(tmp_path, 0, 0, **RUNNER_KV_LIMITS)


def test_folder_without_safetensors_is_a_checkpoint_error(tmp_path, tiny_model_dir):
    shutil.copy(tiny_model_dir("llama") / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no safetensors"):
        load_layer_range(tmp_path, 0, 0, **RUNNER_KV_LIMITS)


def make_hub_cache(cache_dir, repo_id, source_folder):
    """A huggingface_hub cache layout (refs/main -> snapshots/<commit>) holding a copy of source_folder."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_folder = cache_dir / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(source_folder, repo_folder / "snapshots" / commit)
    (repo_folder / "refs").mkdir()
    (repo_folder / "refs" / "main").write_text(commit)
    return repo_folder / "snapshots" / commit


def test_hub_id_resolves_from_the_local_snapshot_cache(tmp_path, tiny_model_dir):
    snapshot = make_hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", tiny_model_dir("llama"))
    resolved = resolve_model_path("tiny-org/tiny-llama", cache_dir=tmp_path / "hub", local_files_only=True)
    assert resolved == snapshot
    runner = load_layer_range("tiny-org/tiny-llama", 0, 1, cache_dir=tmp_path / "hub", local_files_only=True,
                              **RUNNER_KV_LIMITS)
    assert runner.info.model_id == "tiny-org/tiny-llama"
    assert runner.info.path == snapshot


def test_uncached_hub_id_without_downloads_is_a_checkpoint_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="nor in the local hub cache"):
        resolve_model_path("tiny-org/absent", cache_dir=tmp_path)


def test_missing_local_folder_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model_path(tmp_path / "absent")
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model_path("./absent/model")
