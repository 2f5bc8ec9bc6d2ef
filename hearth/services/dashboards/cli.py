"""The `hearth dashboards` commands (build the Grafana JSON, render PNGs) and `hearth status`; bodies import lazily."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

dashboards_app = typer.Typer(help="The Grafana dashboards of a mesh (grafana/dashboards/).", no_args_is_help=True,
                             rich_markup_mode=None)

ReadModelOption = Annotated[Path, typer.Option("--db", help="The read-model SQLite file (hearth projector --db).")]


def refuse_installed_default(command: str, folder: Path) -> None:
    """Exit 2 saying why when `folder`, the default of `command` given no --out, is an installed hearth's own."""
    from hearth.services.common.hearth_files import installed_files_refusal

    if refusal := installed_files_refusal(command, folder):
        typer.echo(refusal, err=True)
        raise typer.Exit(2)


@dashboards_app.command("build")
def build_command(
    out: Annotated[Optional[Path], typer.Option(
        "--out", help="Folder to write into (default: this checkout's grafana/dashboards; an installed hearth writes "
                      "only into --out, and --check alone checks the dashboards it ships).",
        show_default=False)] = None,
    check: Annotated[bool, typer.Option("--check", help="Write nothing; exit 1 naming files that differ.")] = False,
) -> None:
    """Write each dashboard's Grafana JSON from hearth/services/dashboards/panels.py."""
    from hearth.services.dashboards.grafana_json import DASHBOARDS_DIR, write_dashboards

    if out is None and not check:
        refuse_installed_default("hearth dashboards build", DASHBOARDS_DIR)
    stale = write_dashboards(out or DASHBOARDS_DIR, check=check)
    for name in stale:
        typer.echo(f"{'differs' if check else 'wrote'}: {name}")
    raise typer.Exit(1 if check and stale else 0)


@dashboards_app.command("render")
def render_command(
    db: ReadModelOption,
    out: Annotated[Optional[Path], typer.Option(
        "--out", help="Folder for one PNG per dashboard (default: this checkout's docs/img, the README's pictures; "
                      "an installed hearth needs --out).", show_default=False)] = None,
) -> None:
    """Draw each dashboard as a PNG (matplotlib) from the same panel queries Grafana runs, on `--db`."""
    from hearth.services.common.hearth_files import data_dir
    from hearth.services.dashboards.render import RenderRefused, render_all

    if out is None:
        out = data_dir("docs") / "img"
        refuse_installed_default("hearth dashboards render", out)
    try:
        paths = render_all(db, out)
    except RenderRefused as error:
        typer.echo(f"hearth dashboards render: {error}", err=True)
        raise typer.Exit(1) from None
    for path in paths:
        typer.echo(f"wrote {path}")


def status_command(ctx: typer.Context, db: ReadModelOption = Path("readmodel.sqlite")) -> None:
    """One screen from a read model: models and their layer coverage per quantization scheme and weights, shards
    advertised (state by the router's rule, heartbeat age, p95 step, reputation), the shards verification found
    fault with (quarantined, mismatches, disputes), calls in the last hour by outcome (and how many of the checked
    ones had their verification unmet)."""
    from hearth.services.cli_options import settings
    from hearth.services.dashboards.status import run_status_command

    # Which shards are live is the router's rule, with the orchestrators' settings (this invocation's configuration).
    distributed = settings(ctx).research.distributed_inference
    routing = {"shard_health_timeout_s": distributed.shard_health_timeout_s,
               "silent_log_grace_s": distributed.silent_log_grace_s}
    raise typer.Exit(run_status_command(db, routing=routing))
