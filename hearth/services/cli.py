"""The `hearth` command: one typer app whose subcommands import their own modules only when they run.

Keeping imports inside the command functions is what lets `hearth nats`, `hearth projector` and
`hearth-replay` start without loading torch (tests/unit/test_cli_imports.py checks it).

Adding a command: write a function decorated with `@app.command("name")` (or a sub-app with
`app.add_typer`), take `--nats` through `NatsUrlOption` and read the configuration with `settings(ctx)`
(both from services.cli_options), and import the service module inside the function body.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import click
import typer

from hearth.services.cache_cli import cache_app
from hearth.services.cli_errors import OneLineErrorsGroup
from hearth.services.community_cli import community_app
from hearth.services.db_cli import db_app
from hearth.services.dashboards.cli import dashboards_app, status_command
from hearth.services.doctor.command import doctor_command
from hearth.services.gateway.command import gateway_command
from hearth.services.host.cli import host_command
from hearth.services.cli_options import (
    EXIT_BAD_INPUT,
    SHARD_STOPPING_HELP,
    STOPPING_HELP,
    ConfigOption,
    CredsOption,
    InsecureOption,
    FINITE_FLOAT_METAVAR,
    finite_between,
    LogLevelOption,
    MetricsHostOption,
    MetricsPortOption,
    NatsUrlOption,
    ReadyFileOption,
    WaitForNatsOption,
    above_zero,
    apply_top_level_options,
    long_running,
    node_id_for,
    resolve_nats_url,
    settings,
    use_credentials,
    use_metrics_host,
    wait_for_nats,
)
from hearth.services.model_options import (
    HostNodeIdOption,
    ModelIdOption,
    DeviceOption,
    DtypeOption,
    QuantizeOption,
    BusyThreadsOption,
    TorchThreadsOption,
)
from hearth.protocol.chat import ChatRequest, default_max_tokens, max_choices, max_temperature, seed_limit
from hearth.services.common.logging import default_log_level
from hearth.services.nats_cli import NATS_HELP_EPILOG, nats_command
from hearth.services.schema.cli import docs_command, schema_command
from hearth.events.models import default_hop_weight
from hearth.services.weights_cli import weights_app

class CommandsWithDevTools(OneLineErrorsGroup):
    """The `hearth` commands (a file system error: one line, as OneLineErrorsGroup says), and the dev tooling's
    (hearth/services/devtools/commands.py: bench, eval, demo) imported only when one of them runs or the help lists
    them: nothing else the CLI starts loads the tooling."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *DEV_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in DEV_COMMANDS:
            from hearth.services.devtools.commands import dev_commands

            return dev_commands().get_command(ctx, cmd_name)
        return super().get_command(ctx, cmd_name)


DEV_COMMANDS = ("bench", "demo", "eval")

app = typer.Typer(
    name="hearth",
    cls=CommandsWithDevTools,
    help="hearth: run one LLM across the machines of a community mesh (sharded layers over NATS).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Help texts name configuration tables as `[shard]`: shown as written, not read as markup.
    rich_markup_mode=None,
)
# Each group refuses in one line too, so that a file error names the whole command (`hearth db upgrade: ...`).
app.add_typer(db_app, name="db", cls=OneLineErrorsGroup)
app.add_typer(community_app, name="community", cls=OneLineErrorsGroup)
app.add_typer(dashboards_app, name="dashboards", cls=OneLineErrorsGroup)
app.add_typer(weights_app, name="weights", cls=OneLineErrorsGroup)
app.add_typer(cache_app, name="cache", cls=OneLineErrorsGroup)
app.command("schema")(schema_command)
app.command("docs")(docs_command)
# Decorated with @long_running: SIGINT/SIGTERM stop them quietly from the moment `hearth` starts.
LONG_RUNNING_COMMANDS = ("projector", "shard", "orchestrator", "gateway", "host")

@app.callback()
def main_options(
    ctx: typer.Context,
    config: ConfigOption = None,
    log_level: LogLevelOption = default_log_level,
) -> None:
    """hearth: run one LLM across the machines of a community mesh (sharded layers over NATS)."""
    from hearth.services.common.lifecycle import default_stop_signals

    if ctx.invoked_subcommand not in LONG_RUNNING_COMMANDS:
        default_stop_signals()  # SIGINT/SIGTERM as in any Python program; the others keep main()'s handlers
    apply_top_level_options(ctx, config, log_level)


app.command("nats", epilog=NATS_HELP_EPILOG)(nats_command)
app.command("status")(status_command)
app.command("doctor")(doctor_command)
app.command("gateway", epilog=STOPPING_HELP)(gateway_command)
app.command("host", epilog=SHARD_STOPPING_HELP)(host_command)


@app.command("projector", epilog=STOPPING_HELP)
@long_running("hearth projector")
def projector_command(
    ctx: typer.Context,
    db: Annotated[Path, typer.Option("--db", help="SQLite read-model file to keep up to date.")],
    nats_url: NatsUrlOption = None,
    metrics_port: MetricsPortOption = 0,
    metrics_host: MetricsHostOption = None,
    wait_for_nats_flag: WaitForNatsOption = False,
    creds: CredsOption = None,
    insecure: InsecureOption = False,
    ready_file: ReadyFileOption = None,
) -> None:
    """Follow both event streams and keep a SQLite read model up to date until SIGINT/SIGTERM."""
    from hearth.services.common.event_trust import event_verifier
    from hearth.services.common.lifecycle import run_until_stopped
    from hearth.services.projector.main import run_projector

    wait_for_nats(ctx, wait_for_nats_flag)
    use_metrics_host(ctx, metrics_host)
    node_id_for("hearth projector", use_credentials(ctx, "hearth projector", creds, insecure), None, "projector")
    url = resolve_nats_url(ctx, nats_url)
    nats_settings = settings(ctx).nats
    verifier = event_verifier(settings(ctx))  # None on an open mesh: every event is applied
    metrics_interface = settings(ctx).metrics.host
    run_until_stopped(lambda stop_event: run_projector(db, url, metrics_port, stop_event=stop_event,
                                                       metrics_host=metrics_interface, nats_settings=nats_settings,
                                                       verifier=verifier, ready_file=ready_file,
                                                       readmodel_settings=settings(ctx).readmodels))




@app.command("shard", epilog=SHARD_STOPPING_HELP)
@long_running("hearth shard")
def shard_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Option("--model", help="Checkpoint folder, GGUF file, ollama:NAME[:TAG] (a model "
                                                       "Ollama pulled here), hub model id or store:NAME (the "
                                                       "community's store: only the layers served are fetched).")],
    layers: Annotated[str, typer.Option("--layers", help="Inclusive layer range to host, e.g. 0-7.")],
    nats_url: NatsUrlOption = None,
    max_streams: Annotated[Optional[int], typer.Option(
        "--max-streams", min=1, help="Concurrent pipelines served (default: [shard] max_concurrent_streams).",
        show_default=False)] = None,
    node_id: HostNodeIdOption = None,
    model_id: ModelIdOption = None,
    hop_weight: Annotated[
        float, typer.Option("--hop-weight", callback=above_zero, help="1.0 = same LAN; larger = farther.")
    ] = default_hop_weight,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    heartbeat_s: Annotated[Optional[float], typer.Option(
        "--heartbeat-s", callback=above_zero, show_default=False,
        help="Seconds between heartbeats (default: [shard] heartbeat_interval_s).")] = None,
    ttl_s: Annotated[Optional[float], typer.Option(
        "--ttl-s", callback=above_zero, show_default=False,
        help="Advertisement time-to-live, seconds (default: [shard] advertisement_ttl_s).")] = None,
    fault: Annotated[
        Optional[str],
        typer.Option("--fault", hidden=True,
                     help="Testing only: nan, scale=X, noise=S, offset=C, bitflip=B, delay_s=S, fail, empty, "
                          "misshape, accuse, after_steps=N, lie_rate=P, fault_seed=N, spare_single_hop "
                          "(hearth/services/shard/faults.py)."),
    ] = None,
    torch_threads: TorchThreadsOption = None,
    busy_threads: BusyThreadsOption = None,
    ready_file: ReadyFileOption = None,
    metrics_port: MetricsPortOption = 0,
    metrics_host: MetricsHostOption = None,
    wait_for_nats_flag: WaitForNatsOption = False,
    creds: CredsOption = None,
    insecure: InsecureOption = False,
) -> None:
    """Host one contiguous layer range of a model: advertise it, heartbeat, serve activation streams."""
    from hearth.services.common.hearth_files import bundled_model_or
    from hearth.services.common.lifecycle import run_until_stopped

    model = bundled_model_or(model)
    wait_for_nats(ctx, wait_for_nats_flag)
    use_metrics_host(ctx, metrics_host)
    node_id = node_id_for("hearth shard", use_credentials(ctx, "hearth shard", creds, insecure), node_id, "shard")
    # torch comes with it: a refusal of the options or the key above is said at once, not after that import.
    from hearth.services.shard.main import run_shard

    url = resolve_nats_url(ctx, nats_url)
    run_until_stopped(lambda stop_event: run_shard(
        model=model, layers=layers, nats_url=url, settings=settings(ctx), node_id=node_id, model_id=model_id,
        max_streams=max_streams, hop_weight=hop_weight, device=device, dtype=dtype, quantize=quantize,
        heartbeat_s=heartbeat_s, ttl_s=ttl_s,
        fault=fault, torch_threads=torch_threads, busy_threads=busy_threads,
        ready_file=str(ready_file) if ready_file else None, metrics_port=metrics_port, stop_event=stop_event,
    ))


@app.command("orchestrator", epilog=STOPPING_HELP)
@long_running("hearth orchestrator")
def orchestrator_command(
    ctx: typer.Context,
    nats_url: NatsUrlOption = None,
    local_model: Annotated[
        Optional[str], typer.Option("--local-model", help="A model this machine may run whole (local fallback).")
    ] = None,
    node_id: Annotated[
        Optional[str], typer.Option("--node-id", help="This orchestrator's id (default: host name).")
    ] = None,
    db: Annotated[
        Optional[Path], typer.Option("--db", help="Routing read-model file (default: a temporary one).")
    ] = None,
    models_dir: Annotated[
        Optional[list[Path]],
        typer.Option("--models-dir", help="Folder of checkpoints a request may name (repeatable): checkpoint folders "
                                          "and folders holding one GGUF by name, GGUF files by stem."),
    ] = None,
    preload: Annotated[
        Optional[list[str]], typer.Option("--preload", help="Load this model's head before serving (repeatable; "
                                          "store:NAME fetches only the head from the community's store).")
    ] = None,
    step_timeout_s: Annotated[
        Optional[float], typer.Option("--step-timeout-s", callback=above_zero,
                                      help="A hop holding a step longer is stalled.")
    ] = None,
    torch_threads: TorchThreadsOption = None,
    busy_threads: BusyThreadsOption = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    ready_file: ReadyFileOption = None,
    metrics_port: MetricsPortOption = 0,
    metrics_host: MetricsHostOption = None,
    wait_for_nats_flag: WaitForNatsOption = False,
    creds: CredsOption = None,
    insecure: InsecureOption = False,
) -> None:
    """Answer llm.chat.request: route over shard hosts, embed and sample locally, stream frames back."""
    from hearth.services.common.lifecycle import run_until_stopped

    wait_for_nats(ctx, wait_for_nats_flag)
    use_metrics_host(ctx, metrics_host)
    node_id = node_id_for("hearth orchestrator", use_credentials(ctx, "hearth orchestrator", creds, insecure), node_id,
                          "orchestrator")
    # torch comes with these: a refusal of the options or the key above is said at once, not after that import.
    from hearth.services.orchestrator.main import OrchestratorOptions, run_orchestrator, with_step_timeout
    from hearth.services.shard.main import configure_torch_threads, default_node_id

    configure_torch_threads(torch_threads)
    options = OrchestratorOptions(node_id=node_id or default_node_id(), db_path=db,
                                  model_search_dirs=tuple(models_dir or ()), local_model=local_model,
                                  busy_threads=busy_threads, metrics_port=metrics_port, device=device,
                                  dtype=dtype, quantize=quantize)
    url = resolve_nats_url(ctx, nats_url)
    run_until_stopped(lambda stop_event: run_orchestrator(
        with_step_timeout(settings(ctx), step_timeout_s), options, url, preload=list(preload or []),
        ready_file=str(ready_file) if ready_file else None, stop_event=stop_event,
    ))


@app.command("chat")
def chat_command(
    ctx: typer.Context,
    prompt: Annotated[str, typer.Argument(help="What to say (a user message, or raw text with --raw); - reads it "
                                          "from stdin, out of sight of the machine's other users (ps).")],
    model: Annotated[
        Optional[str], typer.Option("--model", help="Model id, as the shard hosts advertise it (default: the one "
                                    "model the mesh serves; `hearth models` lists them).", show_default=False)
    ] = None,
    max_tokens: Annotated[Optional[int], typer.Option(
        "--max-tokens", min=1, help=f"Most tokens to generate (default: {default_max_tokens}, fewer where the "
        "model's context leaves fewer).", show_default=False)] = None,
    temperature: Annotated[Optional[finite_between(0.0, max_temperature)], typer.Option(
        "--temperature", metavar=FINITE_FLOAT_METAVAR, help="0 = greedy.")] = 0.0,
    seed: Annotated[Optional[int], typer.Option("--seed", min=0, max=seed_limit - 1,
                                                help="Makes sampling reproducible.")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Send PROMPT as raw text, no chat template.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print every frame as one JSON line.")] = False,
    interactive: Annotated[bool, typer.Option("--interactive", "-i", help="Go on with the conversation: each "
                                              "line read from stdin is the next turn (an empty line or EOF ends "
                                              "it).")] = False,
    choices: Annotated[int, typer.Option("--n", min=1, max=max_choices, help="Independent answers to ask for "
                                         "(each printed under a [choice I] line once all ended).")] = \
        ChatRequest.model_fields["n"].default,
    quantization: Annotated[Optional[str], typer.Option(
        "--quantization", help="Only an answer from weights held in this scheme: none, int8, int4 (any group size) "
        "or int4/gN (default: the most precise one the mesh serves).", show_default=False)] = None,
    nats_url: NatsUrlOption = None,
    creds: CredsOption = None,
    insecure: InsecureOption = False,
) -> None:
    """Send one chat request and print the answer as it streams (stdout; status lines on stderr).

    Exit code 0 after a complete answer, 1 on an error, 2 on a request refused as not valid (bad_request, here or
    by the mesh) or when no answer came in time (NATS unreachable within nats.connect_timeout_s, or no
    orchestrator)."""
    from hearth.services.client.chat import configured_waits
    from hearth.services.client.command import run_chat_command

    use_credentials(ctx, "hearth chat", creds, insecure)
    url = resolve_nats_url(ctx, nats_url)
    configured = settings(ctx)
    code = run_chat_command(url, prompt=prompt, model=model, max_tokens=max_tokens, temperature=temperature,
                            seed=seed, raw=raw, as_json=as_json, nats_settings=configured.nats,
                            choices=choices, quantization=quantization, interactive=interactive,
                            waits=configured_waits(configured.client, configured.orchestrator))
    raise typer.Exit(code)


@app.command("models")
def models_command(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print the answer as JSON.")] = False,
    nats_url: NatsUrlOption = None,
    creds: CredsOption = None,
    insecure: InsecureOption = False,
) -> None:
    """List the models the mesh can serve now (asks llm.models): layer coverage, context length, the default.

    Exit code 0 with an answer, 2 when none came (NATS unreachable within nats.connect_timeout_s, or no
    orchestrator listening)."""
    from hearth.services.client.command import run_models_command

    use_credentials(ctx, "hearth models", creds, insecure)
    url = resolve_nats_url(ctx, nats_url)
    raise typer.Exit(run_models_command(url, as_json=as_json, settings=settings(ctx)))


@app.command("ollama")
def ollama_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print the list as JSON.")] = False,
) -> None:
    """List the models Ollama has pulled onto this machine ($OLLAMA_MODELS, else Ollama's own folders) and whether
    hearth serves each: `--model ollama:NAME:TAG` on shard, host, orchestrator and demo. Ollama need not run."""
    import dataclasses
    import json

    from hearth.inference.errors import CheckpointError
    from hearth.inference.ollama_listing import listing_line, pulled_ollama_models
    from hearth.inference.ollama_models import ollama_models_dir

    try:
        pulled = pulled_ollama_models()
    except CheckpointError as error:
        typer.echo(f"hearth ollama: {error}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    if as_json:
        typer.echo(json.dumps([dataclasses.asdict(model) for model in pulled], indent=2))
        return
    if not pulled:
        typer.echo(f"Ollama has pulled no model into {ollama_models_dir()}")
        return
    width = max(len(model.name) for model in pulled)
    for model in pulled:
        typer.echo(listing_line(model, width))


def main() -> None:
    from hearth.services.common.core_dumps import forbid_core_dumps
    from hearth.services.common.lifecycle import STOP_EXIT_CODE, StopRequested, raise_on_stop_signals
    from hearth.services.common.process_gc import hold_full_collections

    forbid_core_dumps()  # a crash must not write the prompts, answers and keys it holds to disk
    hold_full_collections()  # until the command's event loop starts (hearth/services/common/process_gc.py)
    raise_on_stop_signals()  # a stop while `hearth` starts up (before any command runs) ends it quietly
    try:
        app()
    except StopRequested:
        sys.exit(STOP_EXIT_CODE)


if __name__ == "__main__":
    main()
