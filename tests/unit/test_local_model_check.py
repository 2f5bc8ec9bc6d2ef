"""An orchestrator's --local-model is checked at start, reading no weight (a missing path, an unreadable config, a
family hearth does not serve, no safetensors weights, a GGUF layer in a block type hearth does not read: one line
naming --local-model), and a request may name it by the id llm.models lists it under, though given as a path;
llm.models finds it once per answer."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from hearth.readmodels.queries import ShardCandidate
from hearth.services.common.lifecycle import CommandInputRefused
from hearth.services.orchestrator.catalog import ModelCatalog
from hearth.services.orchestrator.discovery import describe_models
from hearth.services.orchestrator.main import OrchestratorOptions, check_local_model

from .gguf_files import own_cache  # noqa: F401  (a fixture)
from .inference_tiny_models import one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)
from .test_host_gguf_block_types import one_layer_tensor_in_mxfp4

MODEL = Path(__file__).resolve().parents[2] / "models" / "hearth-tiny-llama"


def folder_with_config(tmp_path: Path, text: str) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(text)
    return folder


@pytest.mark.parametrize(("make", "why"), [
    (lambda tmp_path: tmp_path / "nope", "does not exist"),
    (lambda tmp_path: folder_with_config(tmp_path, "{not json"), "its config does not read"),
    (lambda tmp_path: folder_with_config(tmp_path, '{"model_type": "mamba", "architectures": ["MambaForCausalLM"]}'),
     "unsupported architecture MambaForCausalLM"),
    (lambda tmp_path: folder_with_config(tmp_path, (MODEL / "config.json").read_text()), "has no safetensors weights"),
    (lambda tmp_path: one_layer_tensor_in_mxfp4(tmp_path), "stored as MXFP4, a GGUF type hearth does not read"),
], ids=["missing", "config-not-json", "unsupported-family", "no-weights", "gguf-layer-unreadable"])
def test_a_local_model_that_cannot_load_is_refused_in_one_line_naming_the_option(make, why, tmp_path):
    spec = str(make(tmp_path))
    with pytest.raises(CommandInputRefused) as refused:  # a path of this machine: the caller's input, exit 2
        check_local_model(OrchestratorOptions(node_id="o", local_model=spec))
    message = str(refused.value)
    assert message.startswith(f"--local-model {spec}: ") and why in message and "\n" not in message, message


@pytest.mark.parametrize("spec", [None, "store:fetched-when-needed", "nobody-here/not-in-the-hub-cache"])
def test_models_fetched_when_first_needed_are_not_checked_at_start(spec, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_local_model(OrchestratorOptions(node_id="o", local_model=spec))


def test_a_request_names_a_local_model_given_as_a_path_by_its_listed_id(tiny_model_dir, tmp_path):
    folder = shutil.copytree(tiny_model_dir("llama"), tmp_path / "my-own-model")
    check_local_model(OrchestratorOptions(node_id="o", local_model=str(folder)))
    catalog = ModelCatalog(local_model=str(folder))
    assert catalog.local_model_id() == "my-own-model"
    loaded = asyncio.run(catalog.get_requested("my-own-model"))
    assert loaded.model_id == "my-own-model" and loaded.path == folder.resolve()


def served_shard(model_id: str) -> ShardCandidate:
    return ShardCandidate(shard_id=f"{model_id}:0-1@a", model_id=model_id, weights_sha256="0" * 64, node_id="a",
                          layer_lo=0, layer_hi=1, total_layers=2, control_subject="c", hop_weight=1.0,
                          max_concurrent_streams=1, status="advertised", advertised_at=0, expires_at=10,
                          last_seen=None, queue_depth=None, active_streams=None, quantization="none")


def test_llm_models_finds_the_local_model_once_per_answer(tiny_model_dir, tmp_path, monkeypatch):
    folder = shutil.copytree(tiny_model_dir("llama"), tmp_path / "my-own-model")
    advertised = ["my-own-model", "other/a", "other/b", "other/c"]
    router = SimpleNamespace(all_candidates=lambda: [served_shard(model_id) for model_id in advertised],
                             now=lambda: 0.0, alive=lambda shard, now: True)
    resolved, resolve = [], ModelCatalog.resolve
    monkeypatch.setattr(ModelCatalog, "resolve", lambda self, model: resolved.append(model) or resolve(self, model))
    catalog = ModelCatalog(local_model=str(folder))
    reply = asyncio.run(describe_models(router, catalog))
    assert resolved == [str(folder)]  # not once more for each id listed, nor again for its own
    listed = {model.id: model for model in reply.models}
    assert sorted(listed) == sorted(advertised)
    assert listed["my-own-model"].runnable_locally and listed["my-own-model"].context_length is not None
    assert not listed["other/a"].runnable_locally and listed["other/a"].context_length is None
