"""ModelCatalog names a model the way shard hosts advertise it: folder name for paths, the hub id for hub ids."""

from pathlib import Path

from hearth.services.orchestrator.catalog import ModelCatalog


def test_folder_and_search_dir_models_keep_the_folder_name_and_hub_ids_keep_the_id(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    catalog = ModelCatalog(search_dirs=[tmp_path])
    assert catalog.advertised_id(str(folder), folder.resolve()) is None
    assert catalog.advertised_id("my-model", catalog.resolve("my-model")) is None
    snapshot = Path("/cache/models--org--name/snapshots/0123abcd")
    assert catalog.advertised_id("org/name", snapshot) == "org/name"
