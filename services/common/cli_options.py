"""Command-line plumbing shared by `hearth` and `hearth-replay`: the --nats/--config/--log-level options and
the per-invocation settings they lead to (typer only; commands import their heavy modules themselves)."""

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

NatsUrlOption = Annotated[
    Optional[str],
    typer.Option(
        "--nats",
        envvar=NATS_URL_ENV,
        help="NATS server URL (default: nats.url of the configuration, else nats://127.0.0.1:4222).",
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


def apply_top_level_options(ctx: typer.Context, config: Path | None, log_level: str) -> None:
    """What every app's callback does: configure logging, remember the configuration file."""
    from services.common.logging import configure_logging

    try:
        configure_logging(log_level)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--log-level") from error
    ctx.obj = CliState(config_path=config, log_level=log_level)


def cli_state(ctx: typer.Context) -> CliState:
    """The top-level options of this invocation (defaults when a command runs without the callback)."""
    root = ctx.find_root()
    if not isinstance(root.obj, CliState):
        root.obj = CliState(config_path=None, log_level="INFO")
    return root.obj


def settings(ctx: typer.Context) -> "HearthSettings":
    """The configuration for this invocation (file from --config/HEARTH_CONFIG, then env overrides)."""
    return cli_state(ctx).settings()


def resolve_nats_url(ctx: typer.Context, nats_url: str | None) -> str:
    """--nats / $HEARTH_NATS_URL if given, else the configuration's [nats] url."""
    return nats_url or settings(ctx).nats.url
