"""`python -m hearth.services.projector --db PATH [--nats-url URL] [--metrics-port N]`: projector without the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from hearth.services.cli_options import checked_nats_url_option, long_running
from hearth.services.projector.main import main

app = typer.Typer(add_completion=False)


@app.command()
@long_running("projector")
def projector(
    db: Path = typer.Option(..., help="SQLite read-model database (created and migrated if missing)"),
    nats_url: Optional[str] = typer.Option(
        None, "--nats-url", "--nats", callback=checked_nats_url_option, help="NATS URL (default $HEARTH_NATS_URL)"
    ),
    metrics_port: int = typer.Option(0, "--metrics-port", min=0, help="serve Prometheus metrics on this port (0: off)"),
) -> None:
    main(db, nats_url, metrics_port)


if __name__ == "__main__":
    app()
