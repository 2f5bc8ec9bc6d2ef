"""The options the `hearth community` commands share (the community folder, the read model; the broker's is
services.cli_options.CommunityNatsOption, checked as every --nats is) and their one-line refusal (`fail`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NoReturn

import typer

DirOption = Annotated[Path, typer.Option("--dir", help="The community folder (roster.json, keys/).")]
DEFAULT_COMMUNITY_DIR = Path("community")
ReadModelOption = Annotated[Path, typer.Option(
    "--db", help="The read model (the file `hearth projector --db` keeps) that holds the shards' reputation.")]
DEFAULT_READ_MODEL = Path("readmodel.sqlite")


def fail(message: str, command: str = "hearth community") -> NoReturn:
    """Say `message` in one line on stderr, after the command's name, and exit 1."""
    typer.echo(f"{command}: {message}", err=True)
    raise typer.Exit(1)
