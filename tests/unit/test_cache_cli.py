"""`hearth cache` (hearth/services/cache_cli.py, cache_inventory.py): every kind of entry listed with its name, size
and what it holds, a store or hub model a process uses marked in use and kept by `clear`, the other entries removed;
a kind or name that is not there refused in one line; the listing loads no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hearth.formats.cache_layout import IN_USE_LOCK, RANDOM_MARKER_FILE, REMOVED_SUFFIX, describe_entry
from hearth.inference.cache_versions import hold_version, release_held_versions
from hearth.services.cli import app
from hearth.services.cli_options import EXIT_BAD_INPUT

KiB = 1024


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(root))
    yield root
    release_held_versions()


def write(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    return path


def fill(root: Path) -> None:
    """One entry of every kind; the store model in two publications, the hub model in one commit."""
    for digest in ("aaaa", "bbbb"):
        write(root / "store" / "smollm2" / digest / "objects" / "layer-0", 64 * KiB)
        (root / "store" / "smollm2" / digest / IN_USE_LOCK).touch()
    commit = "c" * 40
    write(root / "hearth-partial" / "org--model" / commit / "files" / "model.safetensors", 32 * KiB)
    write(root / "hearth-partial" / "org--model" / "refs" / "main", 0).write_text(commit)
    codes = root / "int4-codes" / "1234abcd"
    write(codes / "model.layers.0.mlp.up_proj.weight.safetensors", 16 * KiB)
    describe_entry(codes, "int4/g32 codes of /models/tiny, read in float32")
    write(root / "gguf" / "5678ef00" / "config.json", 4 * KiB)
    write(root / "random-models" / "tiny" / "model.safetensors", 8 * KiB)
    (root / "random-models" / "tiny" / RANDOM_MARKER_FILE).write_text("{}")
    write(root / "random-models" / "tiny.tokenizer-host-123" / "vocab.json", KiB)  # being written: not an entry


def listed(*args: str) -> list[dict]:
    result = CliRunner().invoke(app, ["cache", "list", "--json", *args])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.output.splitlines()]


def test_every_kind_is_listed_with_its_name_size_and_what_it_holds(cache):
    fill(cache)
    entries = {(entry["kind"], entry["name"]): entry for entry in listed()}
    assert set(entries) == {("store", "smollm2"), ("hub", "org/model"), ("int4-codes", "1234abcd"),
                            ("gguf", "5678ef00"), ("random", "tiny")}
    assert entries["store", "smollm2"]["size_bytes"] >= 128 * KiB
    assert entries["int4-codes", "1234abcd"]["about"] == "int4/g32 codes of /models/tiny, read in float32"
    assert "tiny shape" in entries["random", "tiny"]["about"]
    assert entries["store", "smollm2"]["in_use"] is False and entries["gguf", "5678ef00"]["in_use"] is None
    table = CliRunner().invoke(app, ["cache", "list"])
    assert table.exit_code == 0 and "org/model" in table.output and "5 entries" in table.output


def test_a_store_version_a_process_uses_is_marked_and_kept_the_rest_removed(cache):
    fill(cache)
    model = cache / "store" / "smollm2"
    hold_version(model, model / "aaaa")  # as a running shard holds the publication it serves
    assert {entry["name"]: entry["in_use"] for entry in listed() if entry["kind"] == "store"} == {"smollm2": True}
    result = CliRunner().invoke(app, ["cache", "clear", "store", "smollm2"])
    assert result.exit_code == 0, result.output
    assert "kept 1 version(s) of store smollm2: a running process uses them" in result.output
    assert sorted(path.name for path in model.iterdir() if not path.name.startswith(".")) == ["aaaa"]
    assert (model / "aaaa" / "objects" / "layer-0").is_file()
    release_held_versions()  # the process ended
    assert "removed store smollm2" in CliRunner().invoke(app, ["cache", "clear", "store"]).output
    assert [entry for entry in listed() if entry["kind"] == "store"] == []


def test_clear_all_removes_every_entry_and_what_an_interrupted_removal_left(cache):
    fill(cache)
    leftover = write(cache / "int4-codes" / f".old.99{REMOVED_SUFFIX}" / "w.safetensors", 8 * KiB)
    assert "left by a removal cut short" in CliRunner().invoke(app, ["cache", "list"]).output
    result = CliRunner().invoke(app, ["cache", "clear", "all"])
    assert result.exit_code == 0, result.output
    assert listed() == []
    assert not leftover.exists()
    assert (cache / "random-models" / "tiny.tokenizer-host-123").is_dir()  # a writer's staging is its own to remove
    assert "freed" in result.output


def test_clear_one_entry_by_name_leaves_the_others(cache):
    fill(cache)
    result = CliRunner().invoke(app, ["cache", "clear", "hub", "org/model"])
    assert result.exit_code == 0, result.output
    assert ("hub", "org/model") not in {(entry["kind"], entry["name"]) for entry in listed()}
    assert len(listed()) == 4


@pytest.mark.parametrize(("args", "says"), [
    (["clear", "models"], "no kind 'models'"),
    (["clear", "store", "nope"], "no store entry named 'nope' (there are: smollm2)"),
    (["clear", "all", "smollm2"], "name the kind"),
])
def test_a_kind_or_name_that_is_not_there_is_refused_in_one_line(cache, args, says):
    fill(cache)
    result = CliRunner().invoke(app, ["cache", *args])
    assert result.exit_code == EXIT_BAD_INPUT
    assert says in result.output and len(result.output.strip().splitlines()) == 1
    assert len(listed()) == 5  # nothing removed


def test_an_empty_cache_says_so(cache):
    result = CliRunner().invoke(app, ["cache", "list"])
    assert result.exit_code == 0 and "nothing cached" in result.output
    assert "nothing to remove" in CliRunner().invoke(app, ["cache", "clear", "all"]).output


def test_listing_loads_no_torch(cache):
    fill(cache)
    code = ("import sys; sys.argv = ['hearth', 'cache', 'list']\nimport hearth.services.cli as cli\n"
            "try:\n    cli.main()\nexcept SystemExit as exit_:\n    assert exit_.code in (0, None), exit_.code\n"
            "print('LOADED=' + ','.join(m for m in ('torch', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "HEARTH_CACHE_DIR": str(cache)}, cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr
    assert "smollm2" in result.stdout and result.stdout.strip().splitlines()[-1] == "LOADED="
