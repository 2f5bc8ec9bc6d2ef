"""The int4 codes a CPU host rounds a checkpoint's weights into, kept on disk (hearth/inference/int4_code_cache.py):
loading the same layers again reads the codes instead of the weights and holds the very same buffers, a checkpoint of
many weight files in one entry; a rewritten weight file, another scheme or dtype is rounded again; a damaged or
foreign cache file is rounded again and replaced; a cache that cannot be written, or a disk near full, only costs the
rounding; old entries are pruned; a host of another CPU capability sharing the cache folder keeps its own entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hearth.formats.cache_layout import ENTRY_SOURCE_FILE, entry_description
from hearth.inference import int4_code_cache, load_layer_range
from hearth.inference.int4_code_cache import int4_code_cache_root
from hearth.inference.quantization import QuantizedLinear
from tests.runner_limits import RUNNER_KV_LIMITS

from .inference_tiny_models import write_tiny_model

LAYERS = (1, 3)
LINEARS_PER_LAYER = 7  # q, k, v, o; gate, up, down


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def model(tmp_path) -> Path:
    return write_tiny_model(tmp_path / "model", "llama")


def load(path: Path, quantization: str = "int4/g32", **options):
    return load_layer_range(path, *LAYERS, quantization=quantization, **RUNNER_KV_LIMITS, **options)


def held_buffers(runner) -> dict[str, torch.Tensor]:
    return {f"{index}.{name}": tensor for index in range(LAYERS[0], LAYERS[1] + 1)
            for name, tensor in runner._stack.layers[index].named_buffers()}


def assert_same_buffers(first, second) -> None:
    ours, theirs = held_buffers(first), held_buffers(second)
    assert ours.keys() == theirs.keys() and ours
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def cached_files(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "int4-codes").glob("*/*.safetensors"))


def test_a_second_load_reads_the_codes_not_the_weights_and_holds_the_same_buffers(model, cache_dir):
    rounded = load(model)
    files = cached_files(cache_dir)
    assert len(files) == LINEARS_PER_LAYER * (LAYERS[1] - LAYERS[0] + 1)
    # `hearth cache list` names what the entry holds codes of.
    described = f"int4/g32 codes of {model.resolve() / 'model.safetensors'}, read in float32"
    assert entry_description(files[0].parent) == described
    cached = load(model)
    # Only the norms are read from the checkpoint the second time: every Linear's weight comes from the cache.
    assert cached.checkpoint_bytes_read < rounded.checkpoint_bytes_read / 20
    assert set(cached.loaded_tensor_names) == set(rounded.loaded_tensor_names)
    assert_same_buffers(rounded, cached)
    assert all(isinstance(cached._stack.layers[index].mlp.down_proj, QuantizedLinear)
               for index in range(LAYERS[0], LAYERS[1] + 1))
    # Another group size or dtype is another rounding: read and rounded again, in its own entry.
    for options in ({"quantization": "int4/g64"}, {"dtype": "bfloat16"}):
        other = load(model, **options)
        assert other.checkpoint_bytes_read > rounded.checkpoint_bytes_read / 2, options
    assert len({file.parent for file in cached_files(cache_dir)}) == 3


def test_a_checkpoint_of_many_weight_files_is_one_entry(tmp_path, cache_dir, monkeypatch):
    # More files than entries kept: an entry per file would prune the first files' codes while loading the last's.
    monkeypatch.setattr(int4_code_cache, "INT4_CODE_CACHE_MAX_ENTRIES", 2)
    sharded = write_tiny_model(tmp_path / "sharded", "llama", max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2
    rounded, cached = load(sharded), load(sharded)
    assert cached.checkpoint_bytes_read < rounded.checkpoint_bytes_read / 20
    assert_same_buffers(rounded, cached)
    assert list(int4_code_cache_root().iterdir()) == [entry_of(sharded)]


CHILD_LOADS = """
import json, sys
from hearth.inference import load_layer_range
from tests.runner_limits import RUNNER_KV_LIMITS
reads = [load_layer_range(sys.argv[1], *json.loads(sys.argv[2]), quantization="int4/g32",
                          **RUNNER_KV_LIMITS).checkpoint_bytes_read for _ in range(2)]
print(json.dumps(reads))
"""


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT",
                    reason="this CPU runs torch's default kernels")
def test_a_host_of_another_cpu_capability_sharing_the_cache_folder_rounds_its_own_codes(model, cache_dir):
    # torch packs int4 codes for its CPU kernel differently at each capability: another's packing read as its own
    # would multiply by scrambled weights.
    ours = load(model)
    child = subprocess.run(
        [sys.executable, "-c", CHILD_LOADS, str(model), json.dumps(LAYERS)], capture_output=True, text=True,
        timeout=120, cwd=Path(__file__).parents[2],
        env={**os.environ, "ATEN_CPU_CAPABILITY": "default", "HEARTH_CACHE_DIR": str(cache_dir)})
    assert child.returncode == 0, child.stderr[-2000:]
    rounded, cached = json.loads(child.stdout.splitlines()[-1])
    assert rounded > ours.checkpoint_bytes_read / 2 and cached < ours.checkpoint_bytes_read / 20
    assert len({file.parent for file in cached_files(cache_dir)}) == 2
    assert_same_buffers(ours, load(model))  # ours still read from our own entry


def test_a_rewritten_weight_file_is_rounded_again(model, cache_dir):
    first = load(model)
    weights = model / "model.safetensors"
    tensors = load_file(weights)
    name = f"model.layers.{LAYERS[0]}.mlp.up_proj.weight"
    tensors[name] = -tensors[name]
    save_file(tensors, weights, metadata={"format": "pt"})
    second = load(model)
    assert second.checkpoint_bytes_read == first.checkpoint_bytes_read
    changed = f"{LAYERS[0]}.mlp.up_proj.scales_and_zeros"
    assert not torch.equal(held_buffers(first)[changed], held_buffers(second)[changed])
    assert_same_buffers(second, load(model))  # the new codes are the ones cached now


@pytest.mark.parametrize("damage", ["truncated", "foreign", "other_shape"])
def test_a_damaged_or_foreign_cache_file_is_rounded_again_and_replaced(model, cache_dir, damage):
    first = load(model)
    victim = cached_files(cache_dir)[0]
    if damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:100])
    elif damage == "foreign":
        victim.write_bytes(b"not a safetensors file at all")
    else:
        save_file({"packed_codes": torch.zeros(16, 16, dtype=torch.uint8),
                   "scales_and_zeros": torch.zeros(1, 16, 2, dtype=torch.bfloat16)}, victim)
    second = load(model)
    assert second.checkpoint_bytes_read > first.checkpoint_bytes_read / 20  # that one weight read again
    assert_same_buffers(first, second)
    assert load(model).checkpoint_bytes_read < first.checkpoint_bytes_read / 20  # and cached again


def test_a_cache_that_cannot_be_written_or_a_disk_near_full_only_costs_the_rounding(model, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(blocker / "cache"))
    unwritable = load(model)
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(int4_code_cache, "INT4_CODE_CACHE_MIN_FREE_BYTES", 1 << 60)
    near_full = load(model)
    assert cached_files(tmp_path / "cache") == []
    assert_same_buffers(unwritable, near_full)
    monkeypatch.setattr(int4_code_cache, "INT4_CODE_CACHE_MIN_FREE_BYTES", 0)
    load(model)
    assert cached_files(tmp_path / "cache")


def entry_of(model: Path) -> Path:
    return int4_code_cache.int4_code_cache(model.glob("*.safetensors"), torch.float32, "int4/g32").folder


def test_the_least_recently_used_entries_beyond_the_limit_are_pruned(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setattr(int4_code_cache, "INT4_CODE_CACHE_MAX_ENTRIES", 2)
    models = [write_tiny_model(tmp_path / f"model-{seed}", "llama", seed=seed) for seed in (11, 12, 13)]
    load(models[0])
    load(models[1])
    load(models[0])  # read from its entry: now the more recently used
    assert {entry_of(models[0]), entry_of(models[1])} == set(int4_code_cache_root().iterdir())
    load(models[2])
    assert set(int4_code_cache_root().iterdir()) == {entry_of(models[0]), entry_of(models[2])}


def test_a_weight_missing_from_the_checkpoint_is_still_named_in_one_line(model, cache_dir):
    from hearth.inference.errors import CheckpointError

    weights = model / "model.safetensors"
    tensors = load_file(weights)
    del tensors[f"model.layers.{LAYERS[0]}.mlp.up_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"model.layers.{LAYERS[0]}.mlp.up_proj.weight is missing"):
        load(model)


def test_a_load_stopped_while_it_writes_codes_leaves_no_staging_file(model, cache_dir, monkeypatch):
    def stopped_midway(tensors, path):
        Path(path).write_bytes(b"half a file")
        raise KeyboardInterrupt  # Ctrl-C

    monkeypatch.setattr(int4_code_cache, "save_file", stopped_midway)
    with pytest.raises(KeyboardInterrupt):
        load(model)
    assert [file for file in cache_dir.rglob("*") if file.is_file() and file.name != ENTRY_SOURCE_FILE] == []
