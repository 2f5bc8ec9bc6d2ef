"""Models Ollama pulled onto a machine are served by their Ollama names (`ollama:NAME[:TAG]`): found through Ollama's
manifests, read from its blobs, advertised under the name as given; bad names and missing models are one line."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from hearth.inference import CheckpointError, load_layer_range, resolve_model_path, weights_sha256
from hearth.formats.gguf_support import is_gguf_file
from hearth.inference.gguf_parts import publishable_gguf
from hearth.inference.memory import layer_weight_bytes
from hearth.inference.ollama_models import OLLAMA_MODELS_ENV, ollama_manifest_parts
from hearth.inference.quantization import parse_quantization
from hearth.services.common.config import HearthSettings
from hearth.services.host.model_layout import model_layout
from tests.runner_limits import RUNNER_KV_LIMITS

from .gguf_files import own_cache, tiny_gguf  # noqa: F401  (fixtures)
from .inference_tiny_models import one_torch_thread  # noqa: F401  (fixture)

DIGEST = "ab" * 32


def pull(models: Path, source: Path, manifest_path: str, *, layers: list | None = None) -> Path:
    """Lay `source` out as Ollama's pull does: a blob named by its digest, a manifest naming it."""
    blob = models / "blobs" / f"sha256-{DIGEST}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, blob)
    manifest = models / "manifests" / manifest_path
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers if layers is not None else [
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{DIGEST}", "size": 1},
        {"mediaType": "application/vnd.ollama.image.template", "digest": f"sha256:{'cd' * 32}", "size": 1},
    ]}))
    return blob


@pytest.fixture
def ollama_models(tmp_path, monkeypatch):
    models = tmp_path / "ollama-models"
    monkeypatch.setenv(OLLAMA_MODELS_ENV, str(models))
    return models


def test_an_ollama_model_is_read_from_its_blob_and_advertised_by_its_name(tiny_gguf, ollama_models):
    source, _ = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    blob = pull(ollama_models, source, "registry.ollama.ai/library/tiny/q8")

    assert resolve_model_path("ollama:tiny:q8") == blob.resolve() and is_gguf_file(blob)
    assert weights_sha256(blob) == weights_sha256(source)  # one pipeline with hosts holding the file as *.gguf
    runner = load_layer_range("ollama:tiny:q8", 0, 2, **RUNNER_KV_LIMITS)
    assert runner.info.model_id == "ollama:tiny:q8"
    expected = load_layer_range(source, 0, 2, **RUNNER_KV_LIMITS)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(runner.named_parameters(), expected.named_parameters(),
                                                           strict=True))

    layout = asyncio.run(model_layout("ollama:tiny:q8", model_id=None, compute_dtype=torch.float32,
                                      quantize=parse_quantization("int8"), nats_url=None, settings=HearthSettings()))
    assert layout.served_id == "ollama:tiny:q8" and layout.weights_sha256 == weights_sha256(source)
    assert publishable_gguf(Path("ollama:tiny:q8")) == blob


async def test_the_orchestrator_serves_an_ollama_model_under_the_name_its_shards_advertise(tiny_gguf, ollama_models):
    from hearth.services.orchestrator.catalog import ModelCatalog

    source, _ = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    pull(ollama_models, source, "registry.ollama.ai/library/tiny/latest")
    catalog = ModelCatalog(local_model="ollama:tiny")

    loaded = await catalog.get("ollama:tiny")
    # Every spelling of one model is served under its canonical name, so shards given another spelling agree.
    assert loaded.model_id == catalog.local_model_id() == "ollama:tiny:latest"
    assert loaded.weights_sha256 == weights_sha256(source)
    assert load_layer_range("ollama:library/tiny", 0, 0, **RUNNER_KV_LIMITS).info.model_id == "ollama:tiny:latest"
    assert (await catalog.get_requested("ollama:registry.ollama.ai/library/tiny:latest")).model_id == loaded.model_id
    assert (await catalog.get_requested("ollama:tiny:latest")).model_id == loaded.model_id


@pytest.mark.parametrize("name, parts", [
    ("ollama:gemma3", ("registry.ollama.ai", "library", "gemma3", "latest")),
    ("ollama:gemma3:4b", ("registry.ollama.ai", "library", "gemma3", "4b")),
    ("ollama:someone/tiny:v1.5", ("registry.ollama.ai", "someone", "tiny", "v1.5")),
    ("ollama:hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M",
     ("hf.co", "bartowski", "Llama-3.2-1B-Instruct-GGUF", "Q4_K_M")),
    ("ollama:localhost:5000/team/tiny", ("localhost:5000", "team", "tiny", "latest")),
])
def test_names_are_read_with_ollamas_defaults(name, parts):
    assert ollama_manifest_parts(name) == parts


@pytest.mark.parametrize("name", ["ollama:", "ollama:../../etc/passwd", "ollama:a/b/c/d", "ollama:tiny:..",
                                  "ollama:tiny:", "ollama:/tiny", "ollama:ti ny", "ollama:" + "x" * 300,
                                  "ollama:..:80/ns/tiny", "ollama:host:port/ns/tiny", "ollama:tiny:4b\n",
                                  "ollama:tiny\n:4b"])
def test_malformed_names_are_refused_before_any_file_is_opened(name, ollama_models):
    with pytest.raises(CheckpointError, match="not an Ollama model name") as refused:
        resolve_model_path(name)
    assert "\n" not in str(refused.value)


def test_a_missing_model_or_blob_and_a_foreign_manifest_are_one_line_each(tiny_gguf, ollama_models):
    with pytest.raises(CheckpointError, match=r"Ollama has not pulled tiny:7b .*`ollama pull tiny:7b`"):
        resolve_model_path("ollama:tiny:7b")

    source, _ = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    blob = pull(ollama_models, source, "registry.ollama.ai/library/tiny/latest")
    blob.unlink()
    with pytest.raises(CheckpointError, match="blob of tiny:latest .* is missing"):
        resolve_model_path("ollama:tiny")

    pull(ollama_models, source, "registry.ollama.ai/library/projector/latest", layers=[
        {"mediaType": "application/vnd.ollama.image.projector", "digest": f"sha256:{DIGEST}"}])
    with pytest.raises(CheckpointError, match="names 0 weights layers"):
        resolve_model_path("ollama:projector")

    pull(ollama_models, source, "registry.ollama.ai/library/tuned/latest", layers=[
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{DIGEST}"},
        {"mediaType": "application/vnd.ollama.image.adapter", "digest": f"sha256:{'12' * 32}"}])
    with pytest.raises(CheckpointError, match="tuned:latest applies a LoRA adapter"):
        resolve_model_path("ollama:tuned")

    garbage = ollama_models / "manifests" / "registry.ollama.ai" / "library" / "garbage" / "latest"
    garbage.parent.mkdir(parents=True)
    garbage.write_text("[1, 2")
    with pytest.raises(CheckpointError, match="is not one hearth reads"):
        resolve_model_path("ollama:garbage")
    garbage.write_text("[" * 200_000)  # nested past what the JSON parser recurses into
    with pytest.raises(CheckpointError, match="is not one hearth reads"):
        resolve_model_path("ollama:garbage")

    for digest in ("sha256:../../etc/passwd", f"sha256:{DIGEST}\n", f"SHA256:{DIGEST}"):
        pull(ollama_models, source, "registry.ollama.ai/library/odd/latest", layers=[
            {"mediaType": "application/vnd.ollama.image.model", "digest": digest}])
        with pytest.raises(CheckpointError, match="odd:latest .* names its weights by no SHA-256 digest"):
            resolve_model_path("ollama:odd")


def test_hearth_ollama_lists_what_ollama_pulled_and_whether_hearth_serves_it(tiny_gguf, ollama_models, tmp_path):
    import gguf
    from typer.testing import CliRunner

    from hearth.services.cli import app

    source, _ = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    pull(ollama_models, source, "registry.ollama.ai/library/tiny/latest")
    writer = gguf.GGUFWriter(tmp_path / "bert.gguf", "bert")
    writer.add_block_count(12)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (ollama_models / "blobs" / f"sha256-{'ef' * 32}").write_bytes((tmp_path / "bert.gguf").read_bytes())
    manifest = ollama_models / "manifests" / "registry.ollama.ai" / "someone" / "embedder" / "v1"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": f"sha256:{'ef' * 32}"}]}))

    listed = CliRunner().invoke(app, ["ollama"])
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    assert lines[0].startswith("ollama:someone/embedder:v1") and "not served: a 'bert' model" in lines[0]
    assert lines[1].startswith("ollama:tiny:latest") and "llama, 6 layers" in lines[1]
    # its Q8_0 layers, as --quantize auto holds them, and what they take so
    layers_bytes = sum(layer_weight_bytes(source, torch.float32, "int8", device="cpu").values())
    assert lines[1].endswith(f"served, by default in int8 ({layers_bytes / 1e6:.1f} MB of layers)")
    as_json = json.loads(CliRunner().invoke(app, ["ollama", "--json"]).output)
    assert [(model["name"], model["problem"] is None, model["default_scheme"], model["default_layers_bytes"])
            for model in as_json] == [("ollama:someone/embedder:v1", False, None, None),
                                      ("ollama:tiny:latest", True, "int8", layers_bytes)]


def test_an_unreadable_models_folder_is_one_line_naming_it(ollama_models, monkeypatch):
    def refuse(self):
        raise PermissionError(13, "Permission denied")

    (ollama_models / "manifests").mkdir(parents=True)
    monkeypatch.setattr(Path, "is_file", refuse)  # as where the folder belongs to Ollama's service account
    with pytest.raises(CheckpointError, match=r"cannot read Ollama's models in .*ollama-models \(Permission denied\)"):
        resolve_model_path("ollama:tiny")


def test_a_folder_serves_its_gguf_named_so_beside_another_gguf_file(tiny_gguf, tmp_path):
    source, _ = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    folder = tmp_path / "household"
    folder.mkdir()
    named = shutil.copy(source, folder / "model.gguf")
    shutil.copy(source, folder / "model.gguf.part")  # a GGUF inside, as a download in progress is
    assert resolve_model_path(folder) == Path(named).resolve()
    (folder / "model.gguf").unlink()
    assert resolve_model_path(folder) == (folder / "model.gguf.part").resolve()  # the only one, by its magic
