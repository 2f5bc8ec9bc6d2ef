"""A hub GGUF in huggingface_hub's own cache (how GGUFs are usually fetched: `hf download REPO FILE.gguf`) is
served from there, offline too, by every form of its id: a plain id of a repository holding one GGUF, and
"owner/name:FILE.gguf", for a layer range, the head or the whole model, and a host plans from it. A plain id of
such a repository asked for whole resolved to the snapshot's folder (no config.json) instead of its GGUF, and a
GGUF id ignored that cache (downloaded again, or refused offline). Served by a local server that speaks the hub's
protocol, never the real hub."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch
from huggingface_hub import hf_hub_download

from hearth.inference import CheckpointError, read_config_dict, resolve_model_path, weights_sha256
from hearth.inference.quantization import parse_quantization
from hearth.services.common.config import HearthSettings
from hearth.services.host.model_layout import model_layout

from .gguf_files import hub_repository_of_a_tiny_gguf
from .hub_server import fake_hub  # noqa: F401  (fixture)
from .inference_tiny_models import TINY_NUM_LAYERS

REPO = "tiny-org/tiny-gguf"
FILE = "tiny-Q8_0.gguf"


@pytest.fixture
def served(fake_hub, tmp_path, monkeypatch):  # noqa: F811
    """The fake hub serving a repository holding one tiny GGUF and a README, huggingface_hub's cache in the test's
    folder; (hub, the original file)."""
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    gguf_file = hub_repository_of_a_tiny_gguf(tmp_path, FILE)
    fake_hub.repos[REPO] = gguf_file.parent
    return fake_hub, gguf_file


def test_a_plain_id_of_a_one_gguf_repository_asked_for_whole_is_its_gguf(served):
    hub, original = served
    path = resolve_model_path(REPO)

    assert path.name == FILE and path.read_bytes() == original.read_bytes()
    assert read_config_dict(path)["num_hidden_layers"] == TINY_NUM_LAYERS


@pytest.mark.parametrize("model", [REPO, f"{REPO}:{FILE}"])
@pytest.mark.parametrize("needed", [None, (0, 1), "head"])
def test_a_gguf_in_the_hub_cache_serves_its_id_offline(served, tmp_path, monkeypatch, model, needed):
    hub, original = served
    cached = hf_hub_download(REPO, FILE, endpoint=hub.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.requests.clear()

    path = resolve_model_path(model, needed_layers=needed)

    assert path.samefile(cached) and hub.requests == []
    assert weights_sha256(path, cache_dir=tmp_path / "s1") == weights_sha256(original, cache_dir=tmp_path / "s2")


def test_a_host_plans_from_a_gguf_in_the_hub_cache_offline(served, tmp_path, monkeypatch):
    hub, original = served
    hf_hub_download(REPO, FILE, endpoint=hub.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.requests.clear()

    layout = asyncio.run(model_layout(f"{REPO}:{FILE}", model_id=None, compute_dtype=torch.float32,
                                      quantize=parse_quantization("int8"), nats_url=None, settings=HearthSettings()))

    assert layout.total_layers == TINY_NUM_LAYERS and layout.served_id == f"{REPO}:{FILE}"
    assert layout.weights_sha256 == weights_sha256(original, cache_dir=tmp_path / "sums") and hub.requests == []


def test_a_plain_id_of_several_ggufs_in_the_hub_cache_is_refused_naming_them(served, monkeypatch):
    hub, original = served
    shutil.copyfile(original, original.with_name("tiny-Q4_0.gguf"))
    hf_hub_download(REPO, FILE, endpoint=hub.url)
    hf_hub_download(REPO, "tiny-Q4_0.gguf", endpoint=hub.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    with pytest.raises(CheckpointError) as refusal:
        resolve_model_path(REPO, needed_layers=(0, 1))
    message = str(refusal.value)
    assert "\n" not in message and "tiny-Q4_0.gguf" in message and f"{REPO}:tiny-Q4_0.gguf" in message, message
    assert resolve_model_path(f"{REPO}:{FILE}", needed_layers=(0, 1)).name == FILE
