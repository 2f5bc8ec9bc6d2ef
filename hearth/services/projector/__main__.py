"""`python -m hearth.services.projector --db PATH [--nats-url URL] [--metrics-port N]`: projector without the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from hearth.services.cli_errors import OneLineErrorsCommand
from hearth.services.cli_options import checked_nats_url_option, long_running
from hearth.services.projector.main import main

# As hearth's and hearth-replay's: errors shown by their own show() (one line), not in rich's box; no traceback.
app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


@app.command(cls=OneLineErrorsCommand)  # its usage errors in one line, as every hearth command's
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
