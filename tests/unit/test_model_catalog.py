"""ModelCatalog names a model the way shard hosts advertise it: folder name for paths, the hub id for hub ids."""

import shutil
from pathlib import Path

import pytest

from hearth.services.orchestrator.catalog import ModelCatalog, UnknownModel
from tests.unit.gguf_files import own_cache, tiny_gguf  # noqa: F401  (fixtures)


def test_folder_and_search_dir_models_keep_the_folder_name_and_hub_ids_keep_the_id(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    catalog = ModelCatalog(search_dirs=[tmp_path])
    assert catalog.advertised_id(str(folder), folder.resolve()) is None
    assert catalog.advertised_id("my-model", catalog.resolve("my-model")) is None
    snapshot = Path("/cache/models--org--name/snapshots/0123abcd")
    assert catalog.advertised_id("org/name", snapshot) == "org/name"


async def test_a_model_live_shards_serve_that_this_orchestrator_has_no_head_for_says_so_and_how(caplog):
    """A GGUF's shards advertise its file's stem; an orchestrator started without `--preload PATH` finds no head of
    that name. The caller (who saw it listed by llm.models) is told so rather than "not one this orchestrator
    serves", and the operator reads once in the log what to start it with."""
    catalog = ModelCatalog(search_dirs=[])
    catalog.use_advertised(lambda model_id: model_id == "SmolLM2-135M-Instruct.Q4_1")

    for _ in range(2):
        with pytest.raises(UnknownModel) as refused:
            await catalog.get_requested("SmolLM2-135M-Instruct.Q4_1")
        message = str(refused.value)
        assert "served by live shards" in message and "no head" in message and "\n" not in message
    with pytest.raises(UnknownModel) as unknown:
        await catalog.get_requested("made-up")
    assert "not one this orchestrator serves" in str(unknown.value)
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) == 1 and "--preload" in warnings[0]


def test_a_models_dir_lists_gguf_files_by_their_stem_and_folders_holding_one_by_name(tmp_path):
    """`--models-dir` holds what `--model` accepts: checkpoint folders, GGUF files (named as their shards advertise
    them, by the file's stem) and folders holding one GGUF."""
    (tmp_path / "loose.Q8_0.gguf").write_bytes(b"GGUF")
    (tmp_path / "boxed").mkdir()
    (tmp_path / "boxed" / "inside.gguf").write_bytes(b"GGUF")
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(b"GGUF")
    catalog = ModelCatalog(search_dirs=[tmp_path])

    loose = (tmp_path / "loose.Q8_0.gguf").resolve()
    assert catalog.catalog_path("loose.Q8_0") == loose and catalog.resolve("loose.Q8_0") == loose
    assert catalog.advertised_id("loose.Q8_0", loose) is None  # the file's stem, as its shards advertise it
    boxed = (tmp_path / "boxed" / "inside.gguf").resolve()
    assert catalog.catalog_path("boxed") == boxed and catalog.resolve("boxed") == boxed
    assert catalog.catalog_path("two") is None  # which of its GGUFs to serve would be a guess
    assert catalog.catalog_path("loose.Q8_0.gguf") is None and catalog.catalog_path("inside") is None


async def test_a_request_names_a_gguf_of_a_models_dir_by_the_id_its_shards_advertise(tmp_path, tiny_gguf):
    from gguf import GGMLQuantizationType

    written, _ = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    models = tmp_path / "models"
    models.mkdir()
    shutil.copyfile(written, models / "family-tiny.Q8_0.gguf")
    catalog = ModelCatalog(search_dirs=[models])

    loaded = await catalog.get_requested("family-tiny.Q8_0")

    assert loaded.model_id == "family-tiny.Q8_0" and loaded.context_length
