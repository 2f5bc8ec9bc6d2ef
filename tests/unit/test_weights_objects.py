"""Objects of the weights bucket are read no further than stated, a manifest names each of its objects' files once
and never as a path or the cache's own names."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from hearth.inference.quantization import parse_quantization
from hearth.services import weights_objects
from hearth.services.weights_objects import WeightsStoreError, read_small_object
from hearth.services.weights_store import StoredObject, WeightsManifest

SHA = "ab" * 32


class StubJetStream:
    """A JetStream whose weights bucket holds one object: its info states `stated` bytes, its chunks hold `held`
    (1000 bytes each; none ever come when `stalled`)."""

    def __init__(self, stated: int, held: int, *, link: bool = False, stalled: bool = False) -> None:
        self.stated, self.held, self.link, self.stalled = stated, held, link, stalled
        self.read = 0
        self.subscribed = self.unsubscribed = 0

    async def get_last_msg(self, stream, subject):
        info = {"name": "k", "bucket": "b", "nuid": "n", "size": self.stated, "chunks": 1,
                "digest": "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(b"x" * self.held).digest()).decode()}
        if self.link:
            info["options"] = {"link": {"bucket": "b", "name": "other"}}
        return SimpleNamespace(data=json.dumps(info).encode())

    async def stream_info(self, stream, subjects_filter=None):  # the object's one chunk is stored
        return SimpleNamespace(state=SimpleNamespace(subjects={subjects_filter: 1}))

    async def subscribe(self, subject, stream=None, ordered_consumer=False):
        self.subscribed += 1
        chunks = iter(range(0, self.held, 1000))
        store = self

        class Subscription:
            async def next_msg(self, timeout=None):
                if store.stalled:
                    await asyncio.Event().wait()
                start = next(chunks)
                store.read += 1000
                pending = max(0, (store.held - start - 1000 + 999) // 1000)
                return SimpleNamespace(data=b"x" * min(1000, store.held - start),
                                       metadata=SimpleNamespace(num_pending=pending))

            async def unsubscribe(self):
                store.unsubscribed += 1

        return Subscription()


async def test_a_small_object_is_read_no_further_than_its_info_states():
    assert await read_small_object(StubJetStream(3000, 3000), "k", "the manifest of 'm'", 4096) == b"x" * 3000
    understated = StubJetStream(100, 10_000_000)
    with pytest.raises(WeightsStoreError, match="the manifest of 'm' holds more than the 100 bytes stated for it"):
        await read_small_object(understated, "k", "the manifest of 'm'", 4096)
    assert understated.read <= 1000
    with pytest.raises(WeightsStoreError, match="is 5000 bytes, over 4096"):
        await read_small_object(StubJetStream(5000, 5000), "k", "the manifest of 'm'", 4096)
    with pytest.raises(WeightsStoreError, match="is a link to another object"):
        await read_small_object(StubJetStream(10, 10, link=True), "k", "the manifest of 'm'", 4096)


async def test_a_small_object_whose_chunks_never_come_is_refused_within_its_deadline(monkeypatch):
    monkeypatch.setattr(weights_objects, "OBJECT_FETCH_BASE_TIMEOUT_S", 0.2)
    with pytest.raises(WeightsStoreError, match="^the manifest of 'm' did not arrive within 0 s$"):
        await asyncio.wait_for(read_small_object(StubJetStream(100, 100, stalled=True), "k", "the manifest of 'm'",
                                                 4096), 10)


async def test_a_read_given_up_leaves_no_subscription_behind(monkeypatch):
    """Before, nats-py's ObjectStore.get kept its chunk subscription (and its heartbeat and flow-control tasks) when
    a read failed or ran past its deadline: on an orchestrator's connection each failed fetch added one for good."""
    monkeypatch.setattr(weights_objects, "OBJECT_FETCH_BASE_TIMEOUT_S", 0.2)
    for bucket in (StubJetStream(100, 100, stalled=True), StubJetStream(100, 10_000)):
        with pytest.raises(WeightsStoreError):
            await asyncio.wait_for(read_small_object(bucket, "k", "the manifest of 'm'", 4096), 10)
        assert bucket.subscribed == bucket.unsubscribed == 1


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


@pytest.mark.parametrize("broken", [
    {"objects": [{"file": "layer-00000.safetensors", "kind": "layer", "size": 1, "sha256": SHA}]},  # no layer
    {"objects": [{"file": "head.safetensors", "kind": "head", "layer": 0, "size": 1, "sha256": SHA}]},
    {"objects": [], "weight_map": {"model.norm.weight": "head.safetensors"}},  # a file no object is
])
def test_a_manifest_whose_objects_do_not_fit_its_tensors_is_refused(broken):
    """Before, a layer object stating no layer passed, and a fetch of a range then failed with a TypeError
    comparing None to a layer index; a tensor placed in no object passed unnoticed."""
    manifest = {"name": "m", "num_layers": 2, "weights_sha256": SHA, "weight_map": {}, "objects": [], **broken}
    with pytest.raises(ValidationError):
        WeightsManifest.model_validate(manifest)
