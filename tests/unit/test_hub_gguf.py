"""A hub id whose repository holds one GGUF instead of safetensors: a host downloads that file (checked against its
listed SHA-256), sizes its range and loads it from the file, advertising the file's own digest; a repository of
several GGUFs is refused naming them. Served by a local server that speaks the hub's protocol, never the real hub."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch
from gguf import GGMLQuantizationType

from inference import CheckpointError, load_layer_range, resolve_model_path, weights_sha256
from inference.memory import layer_weight_bytes
from inference.quantization import parse_quantization
from services.common.config import HearthSettings
from services.host.model_layout import model_layout
from tests.runner_limits import RUNNER_KV_LIMITS

from .gguf_files import write_tiny_gguf
from .hub_server import fake_hub  # noqa: F401  (fixture)
from .inference_tiny_models import TINY_NUM_LAYERS, one_torch_thread  # noqa: F401  (fixture)

REPO = "tiny-org/tiny-gguf"
FILE = "tiny-Q8_0.gguf"


@pytest.fixture
def served(fake_hub, tmp_path, monkeypatch):  # noqa: F811
    """The fake hub serving a repository holding one tiny Q8_0 GGUF (and a README); (hub, the original file)."""
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "written").mkdir()
    path, _ = write_tiny_gguf(tmp_path / "written", "llama", GGMLQuantizationType.Q8_0)
    repository = tmp_path / "repository"
    repository.mkdir()
    shutil.copyfile(path, repository / FILE)
    (repository / "README.md").write_text("a tiny GGUF\n")
    fake_hub.repos[REPO] = repository
    return fake_hub, repository / FILE


def test_a_shard_downloads_the_one_gguf_and_loads_its_range_as_from_the_file(served, tmp_path):
    hub, original = served
    path = resolve_model_path(REPO, needed_layers=(2, 3))

    assert path.name == FILE and hub.downloaded(REPO) == {FILE}
    assert torch.equal(*(dict(load_layer_range(p, 2, 3, **RUNNER_KV_LIMITS).named_parameters())
                         ["model.layers.2.self_attn.q_proj.weight"] for p in (path, original)))
    assert weights_sha256(path, cache_dir=tmp_path / "s1") == weights_sha256(original, cache_dir=tmp_path / "s2")

    hub.requests.clear()
    again = resolve_model_path(REPO, needed_layers="head", local_files_only=True)
    assert again == path and hub.requests == []


def test_a_host_sizes_its_range_from_the_downloaded_gguf(served, tmp_path):
    hub, original = served
    scheme = parse_quantization("int8")
    layout = asyncio.run(model_layout(REPO, model_id=None, compute_dtype=torch.float32, scheme=scheme, nats_url=None,
                                      settings=HearthSettings()))

    expected = layer_weight_bytes(original, torch.float32, quantization=scheme)
    assert layout.total_layers == TINY_NUM_LAYERS and layout.served_id == REPO
    assert layout.layer_bytes == [expected[index] for index in range(TINY_NUM_LAYERS)]
    assert layout.weights_sha256 == weights_sha256(original, cache_dir=tmp_path / "sums")
    hub.requests.clear()
    resolve_model_path(REPO, needed_layers=(0, 1))
    assert hub.downloaded(REPO) == set()  # the file sizing downloaded is the one loaded


def test_a_repository_of_several_ggufs_is_refused_naming_them(served):
    hub, original = served
    shutil.copyfile(original, original.with_name("tiny-Q4_0.gguf"))
    with pytest.raises(CheckpointError) as refused:
        resolve_model_path(REPO, needed_layers=(0, 1))
    message = str(refused.value)
    assert "\n" not in message and "several GGUF files (tiny-Q4_0.gguf, tiny-Q8_0.gguf)" in message
    assert hub.downloaded(REPO) == set()


def test_a_tampered_gguf_is_refused_with_one_line(served):
    hub, original = served
    hub.tampered[FILE] = original.read_bytes()[:-64] + b"\0" * 64
    with pytest.raises(CheckpointError, match=f"{FILE} does not match its listed SHA-256"):
        resolve_model_path(REPO, needed_layers=(0, 1))
