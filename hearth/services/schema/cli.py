"""The commands on hearth's own docs: `hearth schema` (generates their reference parts from the models)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def schema_command(
    out: Annotated[Path, typer.Option("--out", help="Docs folder to write into.")] = Path("docs"),
    check: Annotated[
        bool, typer.Option("--check", help="Write nothing; exit 1 listing the files that differ from the models.")
    ] = False,
) -> None:
    """Generate the JSON Schemas of the wire messages (docs/schemas/) and docs/configuration.md from the models."""
    from hearth.services.schema.files import run_schema_command

    raise typer.Exit(run_schema_command(out, check=check))
