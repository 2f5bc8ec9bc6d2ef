"""weights_sha256: equal for every copy and shard of a checkpoint, sensitive to one tensor, cached."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from hearth.inference import CheckpointError, load_layer_range, weights_sha256
from tests.runner_limits import RUNNER_KV_LIMITS
from hearth.inference import checksum
from hearth.inference.checksum import WEIGHTS_CACHE_FILE_NAME

from .inference_tiny_models import one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)


@pytest.fixture
def checkpoint(tmp_path, tiny_model_dir):
    """A private copy of a sharded tiny checkpoint (tests modify it)."""
    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_model_dir("llama", max_shard_size="100KB"), copy)
    return copy


def test_every_shard_host_of_the_same_checkpoint_reports_the_same_digest(tmp_path, checkpoint):
    other_machine = tmp_path / "elsewhere" / "same-model"
    shutil.copytree(checkpoint, other_machine)
    first = load_layer_range(checkpoint, 0, 2, **RUNNER_KV_LIMITS)
    second = load_layer_range(other_machine, 3, 5, **RUNNER_KV_LIMITS)
    digest = weights_sha256(first.info.path, cache_dir=tmp_path / "cache-a")
    assert digest == weights_sha256(second.info.path, cache_dir=tmp_path / "cache-b")
    assert len(digest) == 64 and int(digest, 16) >= 0


def test_changing_one_tensor_changes_the_digest(tmp_path, checkpoint):
    before = weights_sha256(checkpoint, cache_dir=tmp_path / "cache")
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    shard = checkpoint / index["weight_map"]["model.layers.3.mlp.down_proj.weight"]
    tensors = load_file(shard)
    tensors["model.layers.3.mlp.down_proj.weight"][0, 0] += 1.0
    save_file(tensors, shard, metadata={"format": "pt"})
    assert weights_sha256(checkpoint, cache_dir=tmp_path / "cache") != before


def test_second_call_is_served_from_the_cache_until_size_or_mtime_change(tmp_path, checkpoint):
    cache_dir = tmp_path / "cache"
    digest = weights_sha256(checkpoint, cache_dir=cache_dir)
    cached = json.loads((cache_dir / WEIGHTS_CACHE_FILE_NAME).read_text())
    assert cached[str(checkpoint.resolve())]["sha256"] == digest

    # Same size and restored mtime: a cached call cannot notice, which proves it read no weight bytes.
    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    stat = shard.stat()
    content = bytearray(shard.read_bytes())
    content[-1] ^= 0xFF
    shard.write_bytes(bytes(content))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights_sha256(checkpoint, cache_dir=cache_dir) == digest

    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert weights_sha256(checkpoint, cache_dir=cache_dir) != digest


def test_cache_location_follows_the_environment(tmp_path, checkpoint, monkeypatch):
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(tmp_path / "from-env"))
    weights_sha256(checkpoint)
    assert (tmp_path / "from-env" / WEIGHTS_CACHE_FILE_NAME).is_file()


def test_a_corrupt_cache_file_is_ignored(tmp_path, checkpoint):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    (cache_dir / WEIGHTS_CACHE_FILE_NAME).write_text("{not json")
    expected = weights_sha256(checkpoint, cache_dir=tmp_path / "fresh")
    assert weights_sha256(checkpoint, cache_dir=cache_dir) == expected


def test_folder_without_weights_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        weights_sha256(tmp_path, cache_dir=tmp_path / "cache")


def test_hashing_a_weight_sized_file_shows_a_progress_bar_and_a_small_one_none(tmp_path, monkeypatch, capsys):
    # A large model's file takes tens of seconds to hash (minutes from a disk), during a host's planning or after
    # a download: without a bar nothing moves meanwhile. Cut to 1 MiB here, from a weight file's size.
    monkeypatch.setattr(checksum, "HASH_PROGRESS_MIN_BYTES", 1 << 20)
    small, large = tmp_path / "config.json", tmp_path / "model.gguf"
    small.write_bytes(b"{}")
    large.write_bytes(os.urandom(2 << 20))

    checksum.file_sha256(small)
    assert "hashing" not in capsys.readouterr().err
    assert checksum.file_sha256(large) == hashlib.sha256(large.read_bytes()).hexdigest()
    assert "hashing model.gguf" in capsys.readouterr().err
