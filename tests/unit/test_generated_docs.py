"""docs/schemas/ and docs/configuration.md are exactly what `hearth schema` makes of the models now."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from hearth.events.models import EVENT_TYPES
from hearth.services.schema import files as schema_files
from hearth.protocol import chat as chat_protocol
from hearth.protocol.chat_frames import ChatFrame
from hearth.protocol.discovery import DISCOVERY_MESSAGES
from hearth.services.common.config import HearthSettings, load_settings
from hearth.services.common.config_aliases import MOVED_KEYS, dotted

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SCHEMAS = DOCS / "schemas"
REGENERATE = ".venv/bin/hearth schema"


def load_schema(name: str) -> dict:
    return json.loads((SCHEMAS / name).read_text(encoding="utf-8"))


def configuration_page() -> str:
    return (DOCS / "configuration.md").read_text(encoding="utf-8")


def settings_keys(model: type[BaseModel] = HearthSettings, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key of the settings as its path from the root, found without services.schema.configuration's own walk."""
    keys = []
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            keys += settings_keys(field.annotation, (*path, name))
        else:
            keys.append((*path, name))
    return keys


def row_of(page: str, variable: str) -> list[str]:
    """The cells of the configuration table row whose environment variable is `variable`."""
    rows = [line for line in page.splitlines() if line.startswith("| ") and f"`{variable}`" in line]
    assert len(rows) == 1, f"{variable}: {len(rows)} rows"
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", rows[0])[1:-1]]


def test_the_committed_docs_are_what_the_models_generate_now():
    differing = schema_files.differing_files(DOCS)
    assert not differing, (
        "these generated files differ from the models (or are no longer produced):\n"
        + "\n".join(f"  docs/{name}" for name in differing)
        + f"\nrun `{REGENERATE}` and commit the result"
    )


def test_the_chat_request_schema_carries_the_protocol_limits():
    request = load_schema("llm.chat.request.json")
    properties = request["properties"]
    assert properties["max_tokens"]["anyOf"][0]["maximum"] == chat_protocol.max_tokens_limit
    assert properties["max_tokens"]["anyOf"][0]["minimum"] == 1
    assert properties["prompt"]["anyOf"][0]["maxLength"] == chat_protocol.max_prompt_chars
    assert request["additionalProperties"] is False
    assert set(properties) == set(chat_protocol.ChatRequest.model_fields)


def test_every_frame_type_and_every_event_type_has_its_schema_file():
    frame_union = typing.get_args(ChatFrame)[0]
    frame_types = [cls.model_fields["type"].default for cls in typing.get_args(frame_union)]
    assert "token_delta" in frame_types and "done" in frame_types
    for frame_type in frame_types:
        assert load_schema(f"frame.{frame_type}.json")["properties"]["type"]["const"] == frame_type
    assert "shard.advertised" in EVENT_TYPES
    for event_type in EVENT_TYPES:
        assert load_schema(f"event.{event_type}.json")["properties"]["type"]["const"] == event_type


def test_the_discovery_messages_have_schema_files():
    models = {entry["model"] for entry in load_schema("index.json")["schemas"]}
    assert DISCOVERY_MESSAGES
    for model in DISCOVERY_MESSAGES:
        assert f"{model.__module__}.{model.__qualname__}" in models


def test_the_index_lists_exactly_the_schema_files():
    index = load_schema("index.json")
    listed = [entry["file"] for entry in index["schemas"]]
    on_disk = sorted(path.name for path in SCHEMAS.glob("*.json") if path.name != "index.json")
    assert sorted(listed) == on_disk
    events = {entry["type"]: entry["subject"] for entry in index["schemas"] if entry["kind"] == "event"}
    assert events["shard.advertised"] == "hearth.events.shard.<node_id>.<shard_key>.advertised"
    assert events["pipeline.completed"] == "hearth.events.pipeline.<pipeline_id>.completed"


def test_every_settings_key_is_in_the_configuration_page():
    page = configuration_page()
    keys = settings_keys()
    assert ("transport", "step_timeout_s") in keys
    assert ("shard", "serve_shards") in keys and ("research", "distributed_inference", "host", "device") in keys
    for path in keys:
        assert f"### `[{'.'.join(path[:-1])}]`" in page, path
        assert row_of(page, "HEARTH_" + "__".join(path).upper())[0] == f"`{path[-1]}`"


def test_the_configuration_rows_carry_unit_constraint_default_and_description():
    page = configuration_page()
    key, kind, default, constraint, unit, _, description = row_of(page, "HEARTH_TRANSPORT__STEP_TIMEOUT_S")
    assert (kind, default, constraint, unit) == ("float", "`10.0`", "> 0", "seconds")
    assert "stalled" in description
    _, _, default, constraint, unit, _, _ = row_of(page, "HEARTH_TRANSPORT__CHUNK_BYTES")
    assert (default, constraint, unit) == ("`1048576` (1 MiB)", ">= 1024", "bytes")
    _, _, _, _, unit, _, _ = row_of(page, "HEARTH_SHARD__MAX_MEMORY_MB")
    assert unit == "MiB"
    _, kind, _, _, _, _, _ = row_of(page, "HEARTH_RESEARCH__DISTRIBUTED_INFERENCE__ACTIVATION_DTYPE")
    assert kind.startswith("one of `\"auto\"`")
    _, _, default, _, _, _, _ = row_of(page, "HEARTH_NATS__URL")
    assert default == "`\"nats://127.0.0.1:4222\"` (or `$HEARTH_NATS_URL`)"
    # A key without a description of its own is described by its section.
    *_, description = row_of(page, "HEARTH_RESEARCH__ENABLE")
    assert "experimental_disabled" in description


def test_each_moved_key_s_row_names_its_old_places_and_their_variables():
    page = configuration_page()
    for old, new in MOVED_KEYS:
        *_, description = row_of(page, "HEARTH_" + "__".join(new).upper())
        assert f"`{dotted(old)}` (`{'HEARTH_' + '__'.join(old).upper()}`)" in description, (old, new)


def test_the_example_file_on_the_page_is_complete_and_loads_to_the_defaults(tmp_path, monkeypatch):
    for name in list(os.environ):
        if name.startswith("HEARTH_"):
            monkeypatch.delenv(name)
    example = re.search(r"```toml\n(.*?)```", configuration_page(), re.S).group(1)
    parsed = tomllib.loads(example)

    def flat(table: dict, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
        return [key for name, value in table.items()
                for key in (flat(value, (*path, name)) if isinstance(value, dict) else [(*path, name)])]

    commented_out = re.findall(r"^\[(\w+)\]$|^# (\w+) = ", example, re.M)
    unset_keys, table = [], None
    for section, key in commented_out:  # keys unset by default appear as `# key = ""` (TOML has no null)
        table = section or table
        if key:
            unset_keys.append((table, key))
    assert sorted(flat(parsed) + unset_keys) == sorted(settings_keys())
    path = tmp_path / "hearth.toml"
    path.write_text(example, encoding="utf-8")
    assert load_settings(path) == load_settings()


def test_check_reports_what_differs_and_writing_repairs_it(tmp_path, capsys):
    assert schema_files.run_schema_command(tmp_path, check=True) == 1
    assert schema_files.run_schema_command(tmp_path, check=False) == 0
    assert schema_files.run_schema_command(tmp_path, check=True) == 0
    (tmp_path / "schemas" / "frame.done.json").write_text("{}\n")
    (tmp_path / "schemas" / "frame.gone.json").write_text("{}\n")
    capsys.readouterr()
    assert schema_files.run_schema_command(tmp_path, check=True) == 1
    err = capsys.readouterr().err
    assert "frame.done.json" in err and "frame.gone.json" in err and "hearth schema --out" in err
    assert schema_files.write_files(tmp_path) == ["schemas/frame.done.json", "schemas/frame.gone.json"]
    assert not (tmp_path / "schemas" / "frame.gone.json").exists()
    assert schema_files.differing_files(tmp_path) == []


def test_the_hearth_schema_command(tmp_path):
    from hearth.services.cli import app

    result = CliRunner().invoke(app, ["schema", "--check", "--out", str(tmp_path)])
    assert result.exit_code == 1
    result = CliRunner().invoke(app, ["schema", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "configuration.md").is_file() and (tmp_path / "schemas" / "index.json").is_file()
    assert CliRunner().invoke(app, ["schema", "--check", "--out", str(tmp_path)]).exit_code == 0


@pytest.mark.parametrize("code", ["import hearth.services.schema.files",
                                  "import hearth.services.schema.files as s; s.generated_files()"])
def test_the_generator_loads_no_torch(code):
    heavy = ("torch", "transformers", "hearth.inference")
    probe = f"{code}\nimport sys\nprint(sorted(m for m in {heavy!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_hearth_schema_without_out_is_the_checkouts_docs_from_any_folder(tmp_path, monkeypatch):
    """Its default folder is this checkout's docs/, not a docs/ of whatever folder it runs in."""
    from hearth.services.cli import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["schema", "--check"])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "docs").exists()
