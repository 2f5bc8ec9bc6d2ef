"""Objects of the weights bucket are read no further than stated, a manifest names each of its objects' files once
and never as a path or the cache's own names."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from hearth.inference.quantization import parse_quantization
from hearth.services import weights_objects
from hearth.services.weights_objects import WeightsStoreError, read_small_object
from hearth.services.weights_store import StoredObject, WeightsManifest

SHA = "ab" * 32


class StubStore:
    """An object store whose info states `stated` bytes and whose object holds `held`."""

    def __init__(self, stated: int, held: int, *, link: bool = False) -> None:
        self.stated, self.held, self.link = stated, held, link
        self.read = 0

    async def get_info(self, key):
        return SimpleNamespace(size=self.stated, is_link=lambda: self.link)

    async def get(self, key, writeinto=None):
        for _ in range(0, self.held, 1000):
            writeinto.write(b"x" * 1000)
            self.read += 1000


async def test_a_small_object_is_read_no_further_than_its_info_states():
    assert await read_small_object(StubStore(3000, 3000), "k", "the manifest of 'm'", 4096) == b"x" * 3000
    understated = StubStore(100, 10_000_000)
    with pytest.raises(WeightsStoreError, match="the manifest of 'm' holds more than the 100 bytes stated for it"):
        await read_small_object(understated, "k", "the manifest of 'm'", 4096)
    assert understated.read <= 1000
    with pytest.raises(WeightsStoreError, match="is 5000 bytes, over 4096"):
        await read_small_object(StubStore(5000, 5000), "k", "the manifest of 'm'", 4096)
    with pytest.raises(WeightsStoreError, match="is a link to another object"):
        await read_small_object(StubStore(10, 10, link=True), "k", "the manifest of 'm'", 4096)


class StalledStore(StubStore):
    """An object store whose info states an object whose chunks never come (purged, or never written)."""

    async def get(self, key, writeinto=None):
        await asyncio.Event().wait()


async def test_a_small_object_whose_chunks_never_come_is_refused_within_its_deadline(monkeypatch):
    monkeypatch.setattr(weights_objects, "OBJECT_FETCH_BASE_TIMEOUT_S", 0.2)
    with pytest.raises(WeightsStoreError, match="^the manifest of 'm' did not arrive within 0 s$"):
        await asyncio.wait_for(read_small_object(StalledStore(100, 100), "k", "the manifest of 'm'", 4096), 10)


@pytest.mark.parametrize("file", ["..", ".", ".hidden", "a/b", "", "x" * 201])
def test_an_object_file_that_is_no_plain_name_is_refused(file):
    with pytest.raises(ValidationError):
        StoredObject(file=file, kind="file", size=1, sha256=SHA)


def test_a_manifest_naming_a_file_twice_or_the_cache_marker_is_refused():
    def manifest(*files: str) -> dict:
        return {"name": "m", "num_layers": 1, "weights_sha256": SHA, "weight_map": {},
                "objects": [{"file": file, "kind": "file", "size": 1, "sha256": SHA} for file in files]}

    assert WeightsManifest.model_validate(manifest("config.json", "tokenizer.json"))
    for files in (("config.json", "config.json"), ("hearth-partial-checkpoint.json",)):
        with pytest.raises(ValidationError, match="distinct names"):
            WeightsManifest.model_validate(manifest(*files))


def test_tensor_shapes_that_would_size_a_range_wrong_are_refused():
    """Before, a tensor of shape [-10**15] made layer 0 weigh minus 4 PB, and a host with a 256 MiB budget planned to
    load all 32 layers; a layer the manifest lists no tensor of weighed nothing."""
    def manifest(tensors: dict) -> WeightsManifest:
        return WeightsManifest.model_validate({"name": "m", "num_layers": 2, "weights_sha256": SHA, "weight_map": {},
                                               "objects": [], "tensors": tensors})

    for shape in ([-10**15], [2**41]):
        with pytest.raises(ValidationError):
            manifest({"model.layers.0.mlp.down_proj.weight": {"dtype": "F32", "shape": shape}})
    one_layer = manifest({"model.layers.0.mlp.down_proj.weight": {"dtype": "F32", "shape": [64, 64]}})
    with pytest.raises(WeightsStoreError, match="no tensor of layer 1"):
        one_layer.layer_weight_bytes(torch.float32, parse_quantization("none"))
    both = manifest({f"model.layers.{layer}.mlp.down_proj.weight": {"dtype": "F32", "shape": [64, 64]}
                     for layer in range(2)})
    assert both.layer_weight_bytes(torch.float32, parse_quantization("none")) == [64 * 64 * 4] * 2
