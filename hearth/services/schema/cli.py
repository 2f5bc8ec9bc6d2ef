"""The commands on hearth's own docs: `hearth docs` (where they are) and `hearth schema` (generates their reference
parts from the models)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from hearth.services.common.hearth_files import data_dir, installed_files_refusal

# A page is named as `hearth docs` lists it: a file name of docs/ without .md, never a path.
PAGE_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def docs_command(
    page: Annotated[Optional[str], typer.Argument(help="A page (configuration, metrics, operations, protocol, ...): "
                                                       "print its path instead.", show_default=False)] = None,
) -> None:
    """Print the folder of hearth's docs (Markdown, shipped with hearth): configuration.md lists every configuration
    key, metrics.md every metric, operations.md how to run and watch a mesh, protocol.md what travels on the wire."""
    folder = data_dir("docs")
    if page is None:
        typer.echo(folder)
        return
    pages = sorted(path.stem for path in folder.glob("*.md"))
    name = page.removesuffix(".md")
    if not PAGE_NAME_PATTERN.match(name) or name not in pages:
        typer.echo(f"hearth docs: no page {page!r}; the pages: {', '.join(pages)}", err=True)
        raise typer.Exit(2)
    typer.echo(folder / f"{name}.md")


def schema_command(
    out: Annotated[Optional[Path], typer.Option(
        "--out", help="Docs folder to write into (default: this checkout's docs/; an installed hearth writes only "
                      "into --out, and --check alone checks the docs it ships).", show_default=False)] = None,
    check: Annotated[
        bool, typer.Option("--check", help="Write nothing; exit 1 listing the files that differ from the models.")
    ] = False,
) -> None:
    """Generate the JSON Schemas of the wire messages (schemas/) and configuration.md of hearth's docs from the
    models."""
    from hearth.services.schema.files import run_schema_command

    if out is None and not check and (refusal := installed_files_refusal("hearth schema", data_dir("docs"))):
        typer.echo(refusal, err=True)
        raise typer.Exit(2)
    raise typer.Exit(run_schema_command(out, check=check))
