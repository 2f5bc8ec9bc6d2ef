"""ModelCatalog names a model the way shard hosts advertise it: folder name for paths, the hub id for hub ids."""

from pathlib import Path

import pytest

from hearth.services.orchestrator.catalog import ModelCatalog, UnknownModel


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
