"""`store:NAME` models where they are used, against a real nats-server: `hearth host` sizes its range from the
manifest alone, the orchestrator's catalog fetches only the head (the whole model for its local fallback) and
serves it under NAME, a shard loads only its range's objects (its log saying what it fetches), `hearth weights
fetch` takes NAME or store:NAME, and an unreadable GGUF is refused at publishing (GGUFs that load:
tests/integration/test_weights_store_gguf.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hearth.inference import weights_sha256
from hearth.inference.memory import layer_weight_bytes
from hearth.inference.quantization import parse_quantization
from hearth.services.common.config import HearthSettings, NatsSettings
from hearth.services.host.model_layout import model_layout
from hearth.services.orchestrator.catalog import ModelCatalog, UnknownModel
from hearth.services.shard.main import ShardRefused, load_shard
from hearth.services.weights_publish import check_publishable, publish_checkpoint
from hearth.services.weights_store import (
    HEAD_OBJECT,
    LAYER_OBJECT_FORMAT,
    WeightsStoreError,
    fetch_stored_model,
)
from tests.integration.test_weights_store import js  # noqa: F401  (a fixture)
from tests.unit.inference_tiny_models import one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)

NAME = "tiny-llama"


@pytest.fixture
async def published(js, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(tmp_path / "cache"))
    original = tiny_model_dir("llama", max_shard_size="100KB")
    await publish_checkpoint(js, original, NAME)
    return original


def _settings(nats_url: str) -> HearthSettings:
    return HearthSettings(nats=NatsSettings(url=nats_url))


def _cached_weight_objects(tmp_path) -> set[str]:
    return {file.name for file in (tmp_path / "cache" / "store" / NAME).glob("*/objects/*.safetensors")}


@pytest.mark.parametrize("quantize", ["none", "int8"])
async def test_a_host_sizes_its_range_from_the_manifest_as_from_the_folder(published, nats_url, tmp_path, quantize):
    scheme = parse_quantization(quantize)
    layout = await model_layout(f"store:{NAME}", model_id=None, compute_dtype=torch.float32, quantize=scheme,
                                nats_url=nats_url, settings=_settings(nats_url))

    expected = layer_weight_bytes(published, torch.float32, quantization=scheme)
    assert layout.layer_bytes == [expected[index] for index in range(6)]
    assert layout.total_layers == 6 and layout.served_id == NAME
    assert layout.weights_sha256 == weights_sha256(published, cache_dir=tmp_path / "sums")
    assert _cached_weight_objects(tmp_path) == set()  # nothing fetched to plan


async def test_a_shard_loads_only_its_range_from_the_store_under_the_store_name(published, nats_url, tmp_path):
    loaded = await load_shard(model=f"store:{NAME}", lo=2, hi=3, node="n1", settings=_settings(nats_url),
                              model_id=None, device="cpu", dtype="fp32", stop_event=asyncio.Event(),
                              nats_url=nats_url)
    try:
        assert loaded.identity.model_id == NAME
        assert loaded.identity.weights_sha256 == weights_sha256(published, cache_dir=tmp_path / "sums")
        assert _cached_weight_objects(tmp_path) == {LAYER_OBJECT_FORMAT.format(2), LAYER_OBJECT_FORMAT.format(3)}
    finally:
        loaded.runner.close()
    with pytest.raises(ShardRefused, match="no model 'absent'"):
        await load_shard(model="store:absent", lo=0, hi=1, node="n1", settings=_settings(nats_url), model_id=None,
                         device="cpu", dtype="fp32", stop_event=asyncio.Event(), nats_url=nats_url)


async def test_the_catalog_fetches_the_head_and_serves_it_under_the_store_name(published, js, tmp_path):
    catalog = ModelCatalog(local_model=f"store:{NAME}")
    catalog.use_store(js)
    assert catalog.local_model_id() is None  # listed once fetched whole (it could answer no call before)
    assert catalog.path_of_id(NAME, catalog.local_model_at_hand()) is None

    loaded = await catalog.get_requested(NAME)
    assert loaded.model_id == NAME
    assert loaded.weights_sha256 == weights_sha256(published, cache_dir=tmp_path / "sums")
    assert _cached_weight_objects(tmp_path) == {HEAD_OBJECT}
    assert catalog.path_of_id(NAME, catalog.local_model_at_hand()) == loaded.path

    assert await catalog.local_model_for(loaded) is None  # a call does not wait for the whole model's fetch ...
    local = await catalog.local_model_for(loaded, wait_for_fetch=True)  # ... that it started (--preload waits)
    assert local is not None and local.info.model_id == NAME and catalog.local_model_id() == NAME
    assert _cached_weight_objects(tmp_path) == {HEAD_OBJECT, *(LAYER_OBJECT_FORMAT.format(i) for i in range(6))}
    catalog.close()


async def test_a_store_model_the_store_lacks_is_an_unknown_model(published, js):
    catalog = ModelCatalog()
    with pytest.raises(UnknownModel, match="not connected to the store"):
        await catalog.get(f"store:{NAME}")
    catalog.use_store(js)
    with pytest.raises(UnknownModel, match="no model 'absent'"):
        await catalog.get("store:absent")
    with pytest.raises(UnknownModel, match="must be 1-64 letters"):
        await catalog.get("store:../etc")


def test_an_unreadable_gguf_is_refused_at_publishing_with_one_line(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    for path in (tmp_path / "model.gguf", tmp_path):
        with pytest.raises(WeightsStoreError, match="model.gguf is truncated: its header needs at least"):
            check_publishable(path)


def test_weights_fetch_takes_a_stored_model_as_every_model_option_names_it(published, nats_url, monkeypatch):
    from typer.testing import CliRunner

    from hearth.services.cli import app

    monkeypatch.setenv("HEARTH_NATS__INSECURE", "1")
    folders = []
    for spec in (NAME, f"store:{NAME}"):
        result = CliRunner().invoke(app, ["weights", "fetch", spec, "--part", "head", "--nats", nats_url])
        assert result.exit_code == 0, result.output
        folders.append(result.stdout.strip())
    assert folders[0] == folders[1]
    result = CliRunner().invoke(app, ["weights", "fetch", "store:no such name", "--nats", nats_url])
    assert result.exit_code == 2 and result.stderr.strip().splitlines()[-1].startswith(
        "hearth weights fetch: model name 'no such name' must be"), result.output


async def test_a_fetch_says_in_the_log_what_it_fetches_and_when_it_is_done_and_a_cached_part_says_nothing(
        js, published, tmp_path, caplog):
    """A shard host or orchestrator runs with its log in a file, where no progress bar is drawn: a fetch of a big
    model over the LAN would otherwise be minutes without a line between the start and `ready`."""
    caplog.set_level("INFO", logger="hearth.services.weights_store")
    await fetch_stored_model(js, NAME, (2, 3), cache_dir=tmp_path)
    said = [record.getMessage() for record in caplog.records]
    assert any(line.startswith(f"fetching layers 2-3 of {NAME} from the community's store: ") and " MB" in line
               for line in said), said
    assert any(line.startswith(f"fetched layers 2-3 of {NAME} in ") for line in said), said

    caplog.clear()
    await fetch_stored_model(js, NAME, (2, 3), cache_dir=tmp_path)
    assert not any("fetch" in record.getMessage() for record in caplog.records)
