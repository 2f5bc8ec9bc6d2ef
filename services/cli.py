"""The `hearth` command: one typer app whose subcommands import their own modules only when they run.

Keeping imports inside the command functions is what lets `hearth nats`, `hearth projector` and
`hearth-replay` start without loading torch (tests/unit/test_cli_imports.py checks it).

Adding a command: write a function decorated with `@app.command("name")` (or a sub-app with
`app.add_typer`), take `--nats` through `NatsUrlOption`, read the configuration with `settings(ctx)`,
and import the service module inside the function body.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

if TYPE_CHECKING:
    from services.common.config import HearthSettings

NATS_URL_ENV = "HEARTH_NATS_URL"
CONFIG_ENV = "HEARTH_CONFIG"
LOG_LEVEL_ENV = "HEARTH_LOG_LEVEL"

app = typer.Typer(
    name="hearth",
    help="hearth: run one LLM across the machines of a community mesh (sharded layers over NATS).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Manage a read-model SQLite database.", no_args_is_help=True)
app.add_typer(db_app, name="db")

NatsUrlOption = Annotated[
    Optional[str],
    typer.Option(
        "--nats",
        envvar=NATS_URL_ENV,
        help="NATS server URL (default: [nats] url of the configuration, nats://127.0.0.1:4222).",
        show_default=False,
    ),
]
ConfigOption = Annotated[
    Optional[Path],
    typer.Option(
        "--config",
        envvar=CONFIG_ENV,
        help="TOML configuration file (DESIGN.md §9); HEARTH_* environment variables override it.",
        show_default=False,
    ),
]
LogLevelOption = Annotated[
    str, typer.Option("--log-level", envvar=LOG_LEVEL_ENV, help="DEBUG, INFO, WARNING or ERROR.")
]


@dataclass
class CliState:
    """What the top-level options decided, handed to every command through typer's context."""

    config_path: Path | None
    log_level: str
    _settings: "HearthSettings | None" = None

    def settings(self) -> "HearthSettings":
        if self._settings is None:
            from services.common.config import ConfigError, load_settings

            try:
                self._settings = load_settings(self.config_path)
            except ConfigError as error:
                raise typer.BadParameter(str(error), param_hint="--config") from error
        return self._settings


def settings(ctx: typer.Context) -> "HearthSettings":
    """The configuration for this invocation (file from --config/HEARTH_CONFIG, then env overrides)."""
    return _state(ctx).settings()


def resolve_nats_url(ctx: typer.Context, nats_url: str | None) -> str:
    """--nats / $HEARTH_NATS_URL if given, else the configuration's [nats] url."""
    return nats_url or settings(ctx).nats.url


def _state(ctx: typer.Context) -> CliState:
    root = ctx.find_root()
    if not isinstance(root.obj, CliState):
        root.obj = CliState(config_path=None, log_level="INFO")
    return root.obj


@app.callback()
def main_options(
    ctx: typer.Context,
    config: ConfigOption = None,
    log_level: LogLevelOption = "INFO",
) -> None:
    """hearth: run one LLM across the machines of a community mesh (sharded layers over NATS)."""
    from services.common.logging import configure_logging

    try:
        configure_logging(log_level)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--log-level") from error
    ctx.obj = CliState(config_path=config, log_level=log_level)


@app.command("nats")
def nats_command(
    port: Annotated[int, typer.Option("--port", help="Client port to listen on.")] = 4222,
    store: Annotated[
        Path, typer.Option("--store", help="Directory for JetStream data (kept across restarts).")
    ] = Path(".hearth/nats"),
    host: Annotated[
        str, typer.Option("--host", help="Interface to listen on; 0.0.0.0 to accept other machines.")
    ] = "127.0.0.1",
) -> None:
    """Run an embedded nats-server with JetStream (fsync on every write) until SIGINT/SIGTERM."""
    import signal
    import threading

    from services.common.nats_server import EmbeddedNatsServer, NatsServerError

    stop_requested = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop_requested.set())
    server = EmbeddedNatsServer(port=port, store_dir=store, host=host)
    try:
        server.start()
    except NatsServerError as error:
        typer.echo(f"hearth nats: {error}", err=True)
        raise typer.Exit(1) from error
    typer.echo(server.url)
    typer.echo(f"JetStream store: {server.store_dir.resolve()}  (Ctrl-C to stop)", err=True)
    exit_code = 0
    try:
        while not stop_requested.wait(timeout=0.5):
            # A terminal's Ctrl-C reaches nats-server too; that exit is a requested stop, not a crash.
            if not server.is_running() and not stop_requested.wait(timeout=0.5):
                typer.echo("hearth nats: nats-server exited unexpectedly", err=True)
                exit_code = 1
                break
    finally:
        server.stop()
    if exit_code:
        raise typer.Exit(exit_code)


@db_app.command("upgrade")
def db_upgrade_command(
    db: Annotated[Path, typer.Option("--db", help="SQLite read-model file (created when missing).")],
) -> None:
    """Create or migrate a read-model database to the latest schema (Alembic)."""
    from readmodels.db import upgrade_database

    upgrade_database(db)
    typer.echo(f"{db}: schema at the latest revision")


@app.command("projector")
def projector_command(
    ctx: typer.Context,
    db: Annotated[Path, typer.Option("--db", help="SQLite read-model file to keep up to date.")],
    nats_url: NatsUrlOption = None,
    metrics_port: Annotated[
        Optional[int], typer.Option("--metrics-port", help="Serve Prometheus /metrics on this port.")
    ] = None,
) -> None:
    """Follow both event streams and keep a SQLite read model up to date until SIGINT/SIGTERM."""
    from services.common.lifecycle import run_until_stopped
    from services.projector.main import run_projector

    url = resolve_nats_url(ctx, nats_url)
    run_until_stopped(lambda stop_event: run_projector(db, url, metrics_port, stop_event=stop_event))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
