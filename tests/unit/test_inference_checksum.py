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


@pytest.fixture
def hashed_files(monkeypatch):
    """The weight files hashed since, by name (a cached call hashes none)."""
    names: list[str] = []
    real = checksum.file_sha256

    def counted(file):
        names.append(file.name)
        return real(file)

    monkeypatch.setattr(checksum, "file_sha256", counted)
    return names


def test_second_call_is_served_from_the_cache_without_reading_a_weight_byte(tmp_path, checkpoint, hashed_files):
    cache_dir = tmp_path / "cache"
    digest = weights_sha256(checkpoint, cache_dir=cache_dir)
    cached = json.loads((cache_dir / WEIGHTS_CACHE_FILE_NAME).read_text())
    assert cached[str(checkpoint.resolve())]["sha256"] == digest
    hashed_files.clear()

    assert weights_sha256(checkpoint, cache_dir=cache_dir) == digest
    assert hashed_files == []


def _flipped_last_byte(file) -> bytes:
    content = bytearray(file.read_bytes())
    content[-1] ^= 0xFF
    return bytes(content)


def test_a_file_rewritten_in_place_with_its_size_and_mtime_restored_is_hashed_again(tmp_path, checkpoint):
    cache_dir = tmp_path / "cache"
    digest = weights_sha256(checkpoint, cache_dir=cache_dir)
    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    stat = shard.stat()
    shard.write_bytes(_flipped_last_byte(shard))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as `cp -p`, `touch -r` or `rsync -t` leave it
    assert shard.stat().st_size == stat.st_size and shard.stat().st_mtime_ns == stat.st_mtime_ns

    assert weights_sha256(checkpoint, cache_dir=cache_dir) == weights_sha256(checkpoint, cache_dir=tmp_path / "fresh")
    assert weights_sha256(checkpoint, cache_dir=cache_dir) != digest


def test_a_file_replaced_by_another_with_the_same_size_and_mtime_is_hashed_again(tmp_path, checkpoint):
    cache_dir = tmp_path / "cache"
    digest = weights_sha256(checkpoint, cache_dir=cache_dir)
    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    stat = shard.stat()
    replacement = tmp_path / "replacement"
    replacement.write_bytes(_flipped_last_byte(shard))
    os.utime(replacement, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(replacement, shard)

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
