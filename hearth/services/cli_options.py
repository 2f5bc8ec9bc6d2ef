"""Command-line plumbing shared by `hearth` and `hearth-replay`: the --nats/--config/--log-level options and
the per-invocation settings they lead to (typer only; commands import their heavy modules themselves)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, Optional, TypeVar

import typer

from hearth.services.common.config import NATS_URL_ENV
from hearth.services.common.config_sections import max_tcp_port
from hearth.services.common.logging import LOG_LEVEL_ENV

if TYPE_CHECKING:
    from hearth.services.common.config import HearthSettings, NatsSettings

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

CONFIG_ENV = "HEARTH_CONFIG"
# What --help shows as a finite_between option's type (typer shows its pydantic annotation's repr otherwise).
FINITE_FLOAT_METAVAR = "<float>"


def checked_nats_url_option(value: str | None) -> str | None:
    """--nats / $HEARTH_NATS_URL as nats-py can connect to it (services.common.nats_urls), else a usage error."""
    from hearth.services.common.nats_urls import checked_nats_url

    try:
        return None if value is None else checked_nats_url(value)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


NatsUrlOption = Annotated[
    Optional[str],
    typer.Option(
        "--nats",
        envvar=NATS_URL_ENV,
        callback=checked_nats_url_option,
        help="NATS server URL (default: nats.url of the configuration, else nats://127.0.0.1:4222).",
        show_default=False,
    ),
]
# The `hearth community` commands' broker (hearth/services/community_cli_options.py holds their other options).
CommunityNatsOption = Annotated[Optional[str], typer.Option(
    "--nats", callback=checked_nats_url_option, show_default=False,
    help="The community's broker (default: $HEARTH_NATS_URL or [nats] url; a cluster's URLs comma-separated); TLS "
         "as [nats] tls_* say.")]
ConfigOption = Annotated[
    Optional[Path],
    typer.Option(
        "--config",
        envvar=CONFIG_ENV,
        help="TOML configuration file (every key: `hearth docs configuration`); HEARTH_* environment variables "
             "override it.",
        show_default=False,
    ),
]
MetricsPortOption = Annotated[
    int,
    typer.Option("--metrics-port", min=0, max=max_tcp_port,
                 help="Serve Prometheus /metrics on this port, on the interface --metrics-host names "
                      "(every metric: `hearth docs metrics`); 0 = off."),
]
MetricsHostOption = Annotated[
    Optional[str],
    typer.Option("--metrics-host", show_default=False,
                 help="Interface /metrics listens on (default: [metrics] host, 127.0.0.1). /metrics has no "
                      "authentication and names callers: 0.0.0.0 only on a private network (a Prometheus in "
                      "another container)."),
]
WaitForNatsOption = Annotated[
    bool,
    typer.Option(
        "--wait-for-nats",
        help="Keep trying to reach NATS instead of exiting after nats.connect_timeout_s "
             "(as nats.wait_for_broker = true in the configuration does).",
    ),
]
# What the help of every long-running command says about stopping it.
STOPPING_HELP = ("SIGINT (Ctrl-C) or SIGTERM stops it within 2 s with exit code 0. NATS unreachable for "
                 "nats.connect_timeout_s of the configuration ends it with one line and exit code 1, unless "
                 "--wait-for-nats.")
SHARD_STOPPING_HELP = ("SIGINT (Ctrl-C) or SIGTERM withdraws it at once and lets the calls going through it end, "
                       "for at most shard.stop_drain_timeout_s of the configuration, before it exits with code 0 "
                       "(without calls: within 2 s); a second signal exits at once. NATS unreachable for "
                       "nats.connect_timeout_s ends it with one line and exit code 1, unless --wait-for-nats.")
EXIT_BROKER_UNREACHABLE = 1
EXIT_BAD_INPUT = 2
EXIT_REFUSED = 1
LogLevelOption = Annotated[
    str, typer.Option("--log-level", envvar=LOG_LEVEL_ENV, help="DEBUG, INFO, WARNING or ERROR.")
]


@dataclass
class CliState:
    """What the top-level options decided, handed to every command through typer's context."""

    config_path: Path | None
    log_level: str
    program: str = "hearth"  # what a refusal of the configuration starts with: `hearth`, `hearth-replay`
    _settings: "HearthSettings | None" = None
    # --creds of this invocation (`use_creds`): wins over [nats] creds_file of the file and the environment.
    creds_file: Path | None = None

    def settings(self) -> "HearthSettings":
        if self._settings is None:
            from hearth.services.common.config import ConfigError, load_settings

            try:
                self._settings = self._with_creds(load_settings(self.config_path))
            except ConfigError as error:
                refuse_configuration(self.program, error)
        return self._settings

    def _with_creds(self, current: "HearthSettings") -> "HearthSettings":
        if self.creds_file is None:
            return current
        return current.model_copy(update={"nats": current.nats.model_copy(update={"creds_file": self.creds_file})})


def configuration_env(ctx: typer.Context) -> dict[str, str]:
    """The environment that gives the processes a command starts (`hearth demo`, `hearth bench`) the configuration
    it was given (--config or HEARTH_CONFIG), read here first: one they could not use is refused in one line before
    anything starts."""
    from hearth.services.common.config import CONFIG_PATH_ENV

    state = cli_state(ctx)
    state.settings()
    return {CONFIG_PATH_ENV: str(state.config_path.resolve())} if state.config_path is not None else {}


def refuse_configuration(program: str, error: Exception) -> NoReturn:
    """End the command on a configuration it cannot use (a ConfigError): its one line, exit code 2, no traceback."""
    typer.echo(f"{program}: {error}", err=True)
    raise typer.Exit(EXIT_BAD_INPUT)


def apply_top_level_options(ctx: typer.Context, config: Path | None, log_level: str) -> None:
    """What every app's callback does: configure logging, remember the configuration file."""
    from hearth.services.common.logging import configure_logging

    try:
        configure_logging(log_level)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--log-level") from error
    ctx.obj = CliState(config_path=config, log_level=log_level, program=ctx.find_root().info_name or "hearth")


def cli_state(ctx: typer.Context) -> CliState:
    """The top-level options of this invocation (defaults when a command runs without the callback)."""
    root = ctx.find_root()
    if not isinstance(root.obj, CliState):
        root.obj = CliState(config_path=None, log_level="INFO")
    return root.obj


def settings(ctx: typer.Context) -> "HearthSettings":
    """The configuration for this invocation (file from --config/HEARTH_CONFIG, then env overrides)."""
    return cli_state(ctx).settings()


def wait_for_nats(ctx: typer.Context, wait: bool) -> None:
    """`--wait-for-nats` given: this invocation's settings say [nats] wait_for_broker = true."""
    if wait:
        state = cli_state(ctx)
        current = state.settings()
        state._settings = current.model_copy(
            update={"nats": current.nats.model_copy(update={"wait_for_broker": True})})


def use_creds(ctx: typer.Context, creds: Path | None) -> None:
    """`--creds` given (before a subcommand or after it; the later one wins): this invocation's settings say [nats]
    creds_file = it, read with the configuration when first needed."""
    if creds is not None:
        state = cli_state(ctx)
        state.creds_file = creds
        if state._settings is not None:
            state._settings = state._with_creds(state._settings)


def use_metrics_host(ctx: typer.Context, host: str | None) -> None:
    """`--metrics-host` given: this invocation's settings say [metrics] host = it."""
    if host is not None:
        state = cli_state(ctx)
        current = state.settings()
        state._settings = current.model_copy(update={"metrics": current.metrics.model_copy(update={"host": host})})


def long_running(command: str) -> Callable[[F], F]:
    """Decorate a long-running command: SIGINT/SIGTERM end it with exit code 0 and no traceback in any state
    (services.common.lifecycle), an unreachable broker ends it with one line naming the URL, exit code 1, a refusal
    with one line, exit code 1 (2 for a refusal of its input: CommandInputRefused)."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def command_body(*args, **kwargs):
            from hearth.services.common.lifecycle import (
                CommandInputRefused,
                CommandRefused,
                StopRequested,
                end_stopped_process,
                stop_requested,
                stop_signals_raise,
            )
            from hearth.events.streams import StreamsMissing
            from hearth.services.broker.connection import BrokerUnreachable
            from hearth.services.common.config import ConfigError

            try:
                with stop_signals_raise():
                    result = function(*args, **kwargs)
            except StopRequested:
                end_stopped_process()
            except BrokerUnreachable as error:
                typer.echo(f"{command}: {error}", err=True)
                raise typer.Exit(EXIT_BROKER_UNREACHABLE) from None
            except (CommandRefused, StreamsMissing) as error:
                typer.echo(f"{command}: {error}", err=True)
                raise typer.Exit(EXIT_BAD_INPUT if isinstance(error, CommandInputRefused) else EXIT_REFUSED) from None
            except ConfigError as error:  # settings a service read itself (`python -m hearth.services.projector`)
                typer.echo(f"{command}: {error}", err=True)
                raise typer.Exit(EXIT_BAD_INPUT) from None
            if stop_requested():
                end_stopped_process()
            return result

        return command_body  # type: ignore[return-value]

    return decorate


def resolve_nats_url(ctx: typer.Context, nats_url: str | None) -> str:
    """--nats / $HEARTH_NATS_URL if given, else the configuration's [nats] url."""
    return nats_url or settings(ctx).nats.url


def nats_settings_for(ctx: typer.Context, nats_url: str | None) -> "NatsSettings":
    """This invocation's [nats] settings (--config, then the environment), reaching the broker that --nats (or
    $HEARTH_NATS_URL) names."""
    return settings(ctx).nats.model_copy(update={"url": resolve_nats_url(ctx, nats_url)})


CredsOption = Annotated[
    Optional[Path],
    typer.Option("--creds", help="This member's key file (`hearth community add` writes it); also [nats] "
                                 "creds_file or $HEARTH_NATS__CREDS_FILE.", show_default=False),
]
InsecureOption = Annotated[
    bool,
    typer.Option("--insecure", help="Use an open broker without credentials: anyone on it can read prompts and "
                                    "forge routing (for a single machine; warned at every start)."),
]


# What a command given no member key (and no --insecure) tells its user to do.
NO_CREDENTIALS_FIX = ("give --creds FILE (a member key from `hearth community add`), or --insecure to use an open "
                      "broker")


def use_credentials(ctx: typer.Context, command: str, creds: Path | None, insecure: bool):
    """Secure by default: this invocation logs in with `--creds` (or the configured key) and returns its
    Identity; with neither a key nor `--insecure` it ends with one line; `--insecure` warns and returns None."""
    import logging

    from hearth.services.common.identity import IdentityError, load_identity

    state = cli_state(ctx)
    current = state.settings()
    updates = {key: value for key, value in (("creds_file", creds), ("insecure", insecure or None)) if value}
    nats_settings = current.nats.model_copy(update=updates)
    state._settings = current.model_copy(update={"nats": nats_settings})
    if nats_settings.creds_file is None:
        if not nats_settings.insecure:
            typer.echo(f"{command}: no credentials: {NO_CREDENTIALS_FIX}", err=True)
            raise typer.Exit(EXIT_REFUSED)
        logging.getLogger("hearth").warning(
            "%s: running without credentials (--insecure): anyone who reaches the broker can read prompts and "
            "activations and forge routing", command)
        return None
    try:
        return load_identity(nats_settings.creds_file, nats_settings.roster_file)
    except IdentityError as error:
        typer.echo(f"{command}: {error}", err=True)
        raise typer.Exit(EXIT_REFUSED) from None


def roster_checked(command: str, make: Callable[[], T]) -> T:
    """`make()`, which finds the community roster (hearth/services/common/event_trust.py); a member key with none
    ends `command` in one line."""
    from hearth.services.common.identity import IdentityError

    try:
        return make()
    except IdentityError as error:
        typer.echo(f"{command}: {error}", err=True)
        raise typer.Exit(EXIT_REFUSED) from None


def node_id_for(command: str, identity, node_id: str | None, role: str) -> str | None:
    """A host's node id is its member name (broker permissions name it); None: the default (host name). A key
    that no roster names (none was found beside it) is refused: neither its role nor its name could be checked."""
    if identity is None:
        return node_id
    why = member_refusal(identity, role, node_id)
    if why is not None:
        typer.echo(f"{command}: {why}", err=True)
        raise typer.Exit(EXIT_REFUSED)
    return identity.name


def member_refusal(identity, role: str, node_id: str | None) -> str | None:
    """Why the member `identity` (services.common.identity.Identity) may not run as a `role` whose node id is
    `node_id` (None: its member name), in one line saying what fixes it; None when it may."""
    if identity.member is None:
        return (f"no community roster names the key {identity.key.public_key[:12]}... (none beside it, no [nats] "
                f"roster_file): a {role} checks its own role and the members' signatures against it. Put the "
                "community's roster.json beside the key's keys/ folder, or set [nats] roster_file")
    if identity.member.role != role:
        held, needed = _with_article(identity.member.role), _with_article(role)
        return (f"the key belongs to {identity.name}, {held}, not {needed}: {needed} logs in with {needed} member's "
                f"key (the steward adds one: hearth community add --name NAME --role {role})")
    if node_id is not None and node_id != identity.name:
        return f"--node-id {node_id} differs from the member name {identity.name}; a host's node id is its member name"
    return None


def _with_article(role: str) -> str:
    """`role` after its indefinite article ("an orchestrator", "a shard")."""
    return f"{'an' if role[0] in 'aeiou' else 'a'} {role}"


def finite_between(minimum: float, maximum: float) -> Any:
    """The type of a float option taking a finite number from `minimum` to `maximum`: NaN and infinity are refused
    as "Input should be a finite number" (with typer's min/max, NaN, which compares false, was refused as past a
    bound it is not: `--memory-budget-mb nan` "should be less than or equal to 1e12"). Used as Optional[...]: typer
    drops the bounds of an Annotated type given bare; its option takes metavar=FINITE_FLOAT_METAVAR."""
    from pydantic import Field

    return Annotated[float, Field(allow_inf_nan=False, ge=minimum, le=maximum)]


def above_zero(value: float | None) -> float | None:
    """Every command's check of an option that is a duration or a weight: a finite number above 0, as the settings
    and wire messages it ends up in take it, else a usage error before anything starts (before, `hearth shard
    --hop-weight -5` loaded its layers and ended in a traceback, and `--heartbeat-s 0` heartbeated without pause)."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(f"expected a number above 0, got {value:g}")
    return value


def checked_ready_file(value: Path | None) -> Path | None:
    """Every command's --ready-file check: a link planted where it goes is a usage error before anything starts
    (lifecycle.refused_ready_file), not a refusal once the process has loaded its model and serves."""
    from hearth.services.common.lifecycle import refused_ready_file

    if value is not None and (why := refused_ready_file(value)):
        raise typer.BadParameter(why)
    return value


# What every --ready-file's help says of where it writes.
READY_FILE_HELP = ("written whole at once (a synced file beside it renamed over it), mode 0600; a symbolic link at "
                   "that path is refused at start")
ReadyFileOption = Annotated[
    Optional[Path],
    typer.Option("--ready-file", callback=checked_ready_file, show_default=False,
                 help=f"Write this file once the process serves (for scripts, tests): {READY_FILE_HELP}."),
]
