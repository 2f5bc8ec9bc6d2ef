"""The generated files by path, and bringing a docs folder up to date with them or checking it (`hearth schema
[--out DIR] [--check]`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hearth.services.common.hearth_files import data_dir
from hearth.services.schema import COMMAND
from hearth.services.schema.configuration import configuration_page
from hearth.services.schema.wire import INDEX_FILE, wire_schemas

SCHEMAS_DIR = "schemas"
CONFIG_PAGE = "configuration.md"


def json_text(value: Any) -> str:
    """The stable text of a generated JSON file: sorted keys, 2-space indent, one trailing newline."""
    return json.dumps(value, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def generated_files() -> dict[str, str]:
    """Every generated file by its path under the docs folder (forward slashes), with its exact text."""
    schemas = wire_schemas()
    files = {f"{SCHEMAS_DIR}/{schema.file}": json_text(schema.schema()) for schema in schemas}
    files[f"{SCHEMAS_DIR}/{INDEX_FILE}"] = json_text({
        "generated_by": COMMAND,
        "schemas": [schema.index_entry() for schema in schemas],
    })
    files[CONFIG_PAGE] = configuration_page()
    return files


def _leftover_schemas(out: Path, files: dict[str, str]) -> list[str]:
    """JSON files in the schemas folder that no model produces any more."""
    folder = out / SCHEMAS_DIR
    found = sorted(f"{SCHEMAS_DIR}/{path.name}" for path in folder.glob("*.json")) if folder.is_dir() else []
    return [name for name in found if name not in files]


def differing_files(out: Path, files: dict[str, str] | None = None) -> list[str]:
    """Paths (under `out`) that are missing, differ from what the models produce, or are no longer produced."""
    files = generated_files() if files is None else files
    differing = []
    for name, text in files.items():
        path = out / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            differing.append(name)
    return sorted(differing + _leftover_schemas(out, files))


def write_files(out: Path, files: dict[str, str] | None = None) -> list[str]:
    """Bring `out` up to date: write what changed, delete schema files no model produces; the paths touched."""
    files = generated_files() if files is None else files
    changed = differing_files(out, files)
    leftovers = set(_leftover_schemas(out, files))
    for name in changed:
        path = out / name
        if name in leftovers:
            path.unlink()
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(files[name], encoding="utf-8", newline="\n")
    return changed


def run_schema_command(out: Path | None, *, check: bool) -> int:
    """`hearth schema [--out DIR] [--check]`: the exit code (1: --check found files that differ); `out` None is
    hearth's own docs folder (the checkout's docs/, or the copy an installed hearth ships)."""
    files = generated_files()
    regenerate = COMMAND if out is None else f"{COMMAND} --out {out}"
    out = data_dir("docs") if out is None else out
    if check:
        differing = differing_files(out, files)
        for name in differing:
            print(out / name, file=sys.stderr)
        if differing:
            print(f"{len(differing)} generated file(s) differ from the models; run `{regenerate}`", file=sys.stderr)
            return 1
        print(f"{out}: {len(files)} generated files match the models")
        return 0
    changed = write_files(out, files)
    for name in changed:
        print(f"{'removed' if not (out / name).exists() else 'wrote'} {out / name}")
    print(f"{out}: {len(files)} generated files up to date ({len(changed)} changed)")
    return 0
