"""A GGUF in the community's object store, against a real nats-server: published per layer with its bytes and block
types kept, a shard host fetching only its layers' objects (and the orchestrator only the head's) and loading what
the file itself holds, hosts loading the store and hosts loading the file advertising one weights_sha256."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from hearth.inference import load_head, load_layer_range, read_config_dict, weights_sha256
from hearth.inference.memory import layer_weight_bytes
from hearth.inference.quantization import parse_quantization
from hearth.services.cli_options import EXIT_BAD_INPUT
from hearth.services.common.config import HearthSettings, NatsSettings
from hearth.services.host.model_layout import model_layout
from hearth.services.orchestrator.catalog import ModelCatalog
from hearth.services.shard.main import load_shard
from hearth.services.weights_publish import publish_checkpoint
from hearth.services.weights_store import (
    GGUF_EVERY_LAYER_OBJECT,
    GGUF_HEAD_OBJECT,
    GGUF_HEADER_OBJECT,
    GGUF_LAYER_OBJECT_FORMAT,
    WEIGHTS_BUCKET,
    WeightsStoreError,
    fetch_stored_model,
    object_key,
)
from tests.integration.test_weights_store import js  # noqa: F401  (a fixture)
from tests.runner_limits import RUNNER_KV_LIMITS
from tests.unit.gguf_files import LLAMA3_ROPE_OVERRIDES, write_tiny_gguf
from tests.unit.inference_tiny_models import TINY_NUM_LAYERS, one_torch_thread  # noqa: F401  (fixture)

NAME = "tiny-gguf"


@pytest.fixture
async def published(js, tmp_path, monkeypatch):
    """A tiny Q8_0 llama GGUF published as NAME; (the file, its manifest)."""
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "model").mkdir()
    path, _ = write_tiny_gguf(tmp_path / "model", "llama", GGMLQuantizationType.Q8_0)
    return path, await publish_checkpoint(js, path, NAME)


def _fetched(tmp_path) -> set[str]:
    return {file.name for file in (tmp_path / "cache" / "store" / NAME).glob("*/objects/*")
            if not file.name.startswith(".")}


def _same_parameters(first, second) -> bool:
    left, right = dict(first.named_parameters()), dict(second.named_parameters())
    return left.keys() == right.keys() and all(torch.equal(left[name], right[name]) for name in left)


async def test_a_shard_fetches_only_its_layers_and_loads_what_the_gguf_holds(js, published, tmp_path):
    original, manifest = published
    assert manifest.format_version == 2 and manifest.num_layers == TINY_NUM_LAYERS
    assert manifest.weights_sha256 == weights_sha256(original, cache_dir=tmp_path / "sums")

    part = await fetch_stored_model(js, NAME, (2, 3))
    assert _fetched(tmp_path) == {GGUF_HEADER_OBJECT, GGUF_LAYER_OBJECT_FORMAT.format(2),
                                  GGUF_LAYER_OBJECT_FORMAT.format(3)}
    assert part.name == f"{NAME}.gguf"
    held = GGUFReader(part).tensors
    assert {tensor.name.split(".")[1] for tensor in held} == {"2", "3"}
    assert {tensor.tensor_type for tensor in held if len(tensor.shape) == 2} == {GGMLQuantizationType.Q8_0}
    assert _same_parameters(load_layer_range(part, 2, 3, **RUNNER_KV_LIMITS),
                            load_layer_range(original, 2, 3, **RUNNER_KV_LIMITS))
    assert weights_sha256(part, cache_dir=tmp_path / "s2") == manifest.weights_sha256
    assert await fetch_stored_model(js, NAME, (2, 3)) == part  # a second start reuses it


async def test_a_shard_fetches_the_tensors_every_layer_reads_with_its_layers(js, tmp_path, monkeypatch):
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "model").mkdir()
    original, _ = write_tiny_gguf(tmp_path / "model", "llama", GGMLQuantizationType.Q8_0, **LLAMA3_ROPE_OVERRIDES)
    await publish_checkpoint(js, original, NAME)

    part = await fetch_stored_model(js, NAME, (4, 5))

    assert _fetched(tmp_path) == {GGUF_HEADER_OBJECT, GGUF_EVERY_LAYER_OBJECT, GGUF_LAYER_OBJECT_FORMAT.format(4),
                                  GGUF_LAYER_OBJECT_FORMAT.format(5)}
    assert read_config_dict(part)["rope_parameters"] == LLAMA3_ROPE_OVERRIDES["rope_parameters"]
    assert _same_parameters(load_layer_range(part, 4, 5, **RUNNER_KV_LIMITS),
                            load_layer_range(original, 4, 5, **RUNNER_KV_LIMITS))


async def test_a_host_loading_the_store_and_one_loading_the_file_advertise_one_digest(published, nats_url):
    original, _ = published
    common = dict(node="n1", settings=HearthSettings(nats=NatsSettings(url=nats_url)), model_id=None, device="cpu",
                  dtype="fp32", stop_event=asyncio.Event(), nats_url=nats_url)
    from_store = await load_shard(model=f"store:{NAME}", lo=0, hi=1, **common)
    from_file = await load_shard(model=str(original), lo=2, hi=5, **common)
    try:
        assert from_store.identity.weights_sha256 == from_file.identity.weights_sha256
        assert from_store.identity.model_id == NAME
        # The default (auto) resolves a range fetched alone as the whole file: its Q8_0 layers held as int8.
        assert from_store.identity.quantization == from_file.identity.quantization == "int8"
    finally:
        from_store.runner.close()
        from_file.runner.close()


@pytest.mark.parametrize("quantize", ["none", "int8"])
async def test_a_host_sizes_its_range_from_the_manifest_as_from_the_file(published, nats_url, quantize):
    original, _ = published
    scheme = parse_quantization(quantize)
    layout = await model_layout(f"store:{NAME}", model_id=None, compute_dtype=torch.float32, quantize=scheme,
                                nats_url=nats_url, settings=HearthSettings(nats=NatsSettings(url=nats_url)))
    expected = layer_weight_bytes(original, torch.float32, quantization=scheme)
    assert layout.layer_bytes == [expected[index] for index in range(TINY_NUM_LAYERS)]


async def test_a_hosts_default_plan_from_the_manifest_resolves_the_files_scheme(published, nats_url):
    original, _ = published
    layout = await model_layout(f"store:{NAME}", model_id=None, compute_dtype=torch.float32, quantize="auto",
                                nats_url=nats_url, settings=HearthSettings(nats=NatsSettings(url=nats_url)))
    expected = layer_weight_bytes(original, torch.float32, quantization="int8")  # its Q8_0 layers held in int8
    assert layout.scheme.label == "int8"
    assert layout.layer_bytes == [expected[index] for index in range(TINY_NUM_LAYERS)]


async def test_the_orchestrator_fetches_only_the_head_and_tokenizes_as_the_file(js, published, tmp_path):
    original, _ = published
    catalog = ModelCatalog(local_model=f"store:{NAME}")
    catalog.use_store(js)
    loaded = await catalog.get_requested(NAME)
    try:
        assert _fetched(tmp_path) == {GGUF_HEADER_OBJECT, GGUF_HEAD_OBJECT}
        assert loaded.model_id == NAME and loaded.context_length is not None
        assert loaded.weights_sha256 == weights_sha256(original, cache_dir=tmp_path / "sums")
        reference = load_head(original)
        tokens = reference.encode_prompt("the quick brown fox")
        assert loaded.head.encode_prompt("the quick brown fox") == tokens
        assert torch.equal(loaded.head.embed(torch.tensor([tokens])), reference.embed(torch.tensor([tokens])))

        local = await catalog.local_model_for(loaded, wait_for_fetch=True)  # its local fallback: the whole model
        assert local is not None and local.info.model_id == NAME
        assert _fetched(tmp_path) == {GGUF_HEADER_OBJECT, GGUF_HEAD_OBJECT,
                                      *(GGUF_LAYER_OBJECT_FORMAT.format(i) for i in range(TINY_NUM_LAYERS))}
    finally:
        catalog.close()


async def test_a_corrupted_layer_object_is_refused_with_one_line(js, published, tmp_path):
    _, manifest = published
    store = await js.object_store(WEIGHTS_BUCKET)
    await store.put(object_key(NAME, GGUF_LAYER_OBJECT_FORMAT.format(1), manifest.objects_version),
                    b"not the layer that was published")
    with pytest.raises(WeightsStoreError, match="layer-00001.gguf-data of 'tiny-gguf' does not match the SHA-256"):
        await fetch_stored_model(js, NAME, (1, 1))


def test_publishing_a_gguf_the_loader_refuses_fails_in_one_line_before_any_connection(tmp_path):
    truncated = tmp_path / "cut.gguf"
    (tmp_path / "model").mkdir()
    path, _ = write_tiny_gguf(tmp_path / "model", "llama", GGMLQuantizationType.Q8_0)
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    refused = subprocess.run(
        [sys.executable, "-m", "hearth.services.cli", "weights", "publish", str(truncated), "--name", NAME, "--nats",
         "nats://127.0.0.1:9", "--insecure"], capture_output=True, text=True, timeout=120,
        cwd=Path(__file__).resolve().parents[2])
    assert refused.returncode == EXIT_BAD_INPUT
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "hearth weights publish: cut.gguf is truncated: its tensors need " in refused.stderr


async def test_a_damaged_cached_gguf_part_is_written_again_before_it_is_reused(js, published, tmp_path):
    original, _ = published
    part = await fetch_stored_model(js, NAME, (2, 3))
    size = part.stat().st_size
    with part.open("r+b") as handle:  # truncated, as a full disk or a crash leaves a file
        handle.truncate(size // 2)

    again = await fetch_stored_model(js, NAME, (2, 3))
    assert again.stat().st_size == size
    assert _same_parameters(load_layer_range(again, 2, 3, **RUNNER_KV_LIMITS),
                            load_layer_range(original, 2, 3, **RUNNER_KV_LIMITS))


async def test_writing_a_fetched_range_as_a_gguf_shows_a_progress_bar(js, published, monkeypatch, capsys):
    """Before, copying a range's tensors into its GGUF (tens of GB for a large model's range) showed nothing after
    the fetch's bar had finished. Cut to no minimum here, from a weight file's size."""
    from hearth.inference import checksum

    monkeypatch.setattr(checksum, "HASH_PROGRESS_MIN_BYTES", 0)
    await fetch_stored_model(js, NAME, (0, 1))
    assert f"writing {NAME}.gguf" in capsys.readouterr().err


async def test_a_fetched_gguf_range_is_refused_for_publishing(js, published):
    from hearth.services.weights_publish import check_publishable

    with pytest.raises(WeightsStoreError, match=r"holds only part of a checkpoint \(fetched by hearth from "
                                                r"store:tiny-gguf\): publish the original$"):
        check_publishable(await fetch_stored_model(js, NAME, (0, 1)))
