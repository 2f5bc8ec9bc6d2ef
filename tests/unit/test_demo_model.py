"""Which checkpoint `hearth demo` runs: the real GGUF when its package is installed, else the toy; a GGUF file or a
folder holding one as --model; its layers and chat template read from the GGUF's metadata, then from the cache."""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

import gguf
import numpy as np
import pytest

from hearth.inference.gguf_cache import gguf_cache_entry
from hearth.services.devtools import demo_model
from hearth.services.devtools.demo_model import (
    FACTUAL_QUESTION,
    TOY_MODEL_PROMPT,
    DemoError,
    bundled_model_path,
    REAL_DEMO_MODEL_REQUIREMENT,
    default_prompt,
    real_demo_model_hint,
    resolve_demo_model,
)

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def write_metadata_only_gguf(path: Path, *, layers: int = 5, chat_template: str | None = TEMPLATE) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(layers)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def no_real_model(monkeypatch):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(demo_model.metadata, "files", not_installed)


def test_a_gguf_file_is_described_from_its_metadata(tmp_path):
    path = write_metadata_only_gguf(tmp_path / "model.Q4_1.gguf", layers=7)
    model = resolve_demo_model(str(path))
    assert (model.path, model.num_layers, model.has_chat_template) == (path.resolve(), 7, True)
    assert model.is_gguf and model.name == "model.Q4_1"
    assert default_prompt(model) == FACTUAL_QUESTION


def test_a_gguf_without_a_chat_template_is_asked_raw(tmp_path):
    path = write_metadata_only_gguf(tmp_path / "plain.gguf", chat_template=None)
    assert not resolve_demo_model(str(path)).has_chat_template


def test_a_folder_holding_one_gguf_means_that_file(tmp_path):
    path = write_metadata_only_gguf(tmp_path / "only.gguf")
    assert resolve_demo_model(str(tmp_path)).path == path.resolve()


def test_a_folder_holding_several_ggufs_is_refused_naming_them(tmp_path):
    write_metadata_only_gguf(tmp_path / "a.gguf")
    write_metadata_only_gguf(tmp_path / "b.gguf")
    with pytest.raises(DemoError, match=r"several GGUF files \(a.gguf, b.gguf\)"):
        resolve_demo_model(str(tmp_path))


@pytest.mark.parametrize(("content", "why"), [
    (b"", r"broken.gguf is empty \(0 bytes\): not a GGUF file$"),
    (b"GGUF\x03\x00", r"broken.gguf is truncated: its header needs at least 8 bytes, the file holds 6 "),
    (b"not a gguf at all", r"broken.gguf is not a GGUF file \(no GGUF magic\)$"),
], ids=["empty", "cut-in-its-header", "no-magic"])
def test_a_truncated_or_foreign_gguf_is_refused_in_one_line(tmp_path, content, why):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(DemoError, match=why) as raised:
        resolve_demo_model(str(path))
    assert "\n" not in str(raised.value)


def test_a_file_that_is_not_a_gguf_is_refused(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(DemoError, match="not a GGUF"):
        resolve_demo_model(str(path))


def test_a_gguf_named_by_its_digest_is_told_by_its_magic(tmp_path):
    blob = write_metadata_only_gguf(tmp_path / "model.gguf", layers=5).rename(tmp_path / "sha256-0f0f")
    model = resolve_demo_model(str(blob))
    assert (model.path, model.num_layers, model.is_gguf, model.name) == (blob.resolve(), 5, True, "sha256-0f0f")


def write_gguf(path: Path, architecture: str, *, layers: int, tensors: dict) -> Path:
    """A GGUF of `architecture` holding `tensors` (name: (array, GGML type or None for the array's own))."""
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(layers)
    for name, (array, raw_type) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def unservable_ggufs(tmp_path):
    """A one-layer mamba GGUF, and a llama GGUF with a layer tensor in MXFP4 (32 values in 17 bytes a block)."""
    mamba = write_gguf(tmp_path / "mamba.gguf", "mamba", layers=1,
                       tensors={"blk.0.ssm_in.weight": (np.zeros((4, 32), np.float32), None)})
    mxfp4 = write_gguf(tmp_path / "mxfp4.gguf", "llama", layers=2, tensors={
        "blk.0.attn_q.weight": (np.zeros((4, 17), np.uint8), gguf.GGMLQuantizationType.MXFP4),
        # A vision tower's tensor is no part of the text model hearth serves: its type is not checked.
        "v.patch_embd.weight": (np.zeros((4, 17), np.uint8), gguf.GGMLQuantizationType.MXFP4),
    })
    return mamba, mxfp4


def test_a_gguf_no_shard_serves_is_refused_in_the_shards_words(unservable_ggufs):
    from hearth.inference.errors import CheckpointError
    from hearth.inference.gguf_header import checked_gguf_header, read_gguf_header

    mamba, mxfp4 = unservable_ggufs
    with pytest.raises(DemoError, match=r"^GGUF mamba.gguf holds a 'mamba' model; hearth serves llama, ") as refused:
        resolve_demo_model(str(mamba))
    assert refused.value.exit_code == 2
    with pytest.raises(CheckpointError) as shard:
        checked_gguf_header(mamba)
    assert str(shard.value) == str(refused.value)

    with pytest.raises(DemoError, match=r"^tensor blk.0.attn_q.weight of mxfp4.gguf is stored as MXFP4, a GGUF type "
                                        r"hearth does not read \(it reads F32, ") as refused:
        resolve_demo_model(str(mxfp4))
    with pytest.raises(CheckpointError) as shard:
        read_gguf_header(mxfp4, check_tensors=True)
    assert str(shard.value) == str(refused.value)


def test_a_description_kept_before_the_checks_ran_is_read_again(unservable_ggufs):
    mamba, _ = unservable_ggufs
    gguf_cache_entry(mamba).write_json(demo_model.GGUF_DESCRIPTION_CACHE_NAME,
                                       {"num_layers": 1, "has_chat_template": False})
    with pytest.raises(DemoError, match="holds a 'mamba' model"):
        resolve_demo_model(str(mamba))


def test_the_description_is_read_once_per_file_version(tmp_path, monkeypatch):
    path = write_metadata_only_gguf(tmp_path / "cached.gguf", layers=3)
    assert resolve_demo_model(str(path)).num_layers == 3
    monkeypatch.setattr(demo_model, "_read_gguf_description", lambda path: pytest.fail("read again"))
    assert resolve_demo_model(str(path)).num_layers == 3
    monkeypatch.undo()
    before = path.stat().st_mtime_ns
    write_metadata_only_gguf(path, layers=4)  # a changed file is read again
    os.utime(path, ns=(before + 10**9, before + 10**9))
    assert resolve_demo_model(str(path)).num_layers == 4


def test_without_the_package_the_demo_runs_the_bundled_toy(no_real_model):
    model = resolve_demo_model(None, prefer_real=True)
    assert model.path == bundled_model_path() and model.is_default and not model.is_gguf
    assert default_prompt(model) == TOY_MODEL_PROMPT


def test_with_the_package_the_demo_runs_its_gguf_found_without_importing_it(tmp_path, monkeypatch):
    path = write_metadata_only_gguf(tmp_path / demo_model.REAL_DEMO_MODEL_FILE)

    class Listed:
        name = path.name

        def locate(self):
            return path

    monkeypatch.setattr(demo_model.metadata, "files", lambda name: [Listed()])
    model = resolve_demo_model(None, prefer_real=True)
    assert model.path == path.resolve() and model.is_default
    assert resolve_demo_model(None).path == bundled_model_path()  # bench and eval keep the toy as default


def test_a_model_ollama_pulled_runs_under_its_ollama_name(tmp_path, monkeypatch):
    models = tmp_path / "ollama"
    (models / "blobs").mkdir(parents=True)
    blob = write_metadata_only_gguf(tmp_path / "source.gguf", layers=7).rename(models / "blobs" / "sha256-x")
    monkeypatch.setenv("OLLAMA_MODELS", str(models))
    with pytest.raises(DemoError, match="`ollama pull tiny:latest`"):
        resolve_demo_model("ollama:tiny")
    digest = "0f" * 32
    blob = blob.rename(models / "blobs" / f"sha256-{digest}")
    manifest = models / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(f'{{"layers": [{{"mediaType": "application/vnd.ollama.image.model", '
                        f'"digest": "sha256:{digest}"}}]}}')

    model = resolve_demo_model("ollama:tiny")
    assert (model.path, model.num_layers, model.has_chat_template) == (blob.resolve(), 7, True)
    assert model.argument == model.name == "ollama:tiny:latest" and model.is_gguf


def test_the_hint_for_the_real_model_fits_how_hearth_runs_and_pins_what_the_makefile_installs():
    """An installed hearth has no Makefile: its hint names hearth's own environment (pipx's, or this interpreter's);
    both name the release the Makefile installs, whose file the demo looks for."""
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    assert f"DEMO_MODEL_PACKAGE := {REAL_DEMO_MODEL_REQUIREMENT}\n" in makefile
    installed, checkout = real_demo_model_hint(installed=True), real_demo_model_hint(installed=False)
    assert "make" not in installed
    assert f"pipx runpip hearth install --no-deps {REAL_DEMO_MODEL_REQUIREMENT}" in installed
    assert "`make demo`" in checkout and REAL_DEMO_MODEL_REQUIREMENT in checkout
