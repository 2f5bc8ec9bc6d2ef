"""The `hearth bench` command line (its body is hearth/services/devtools/bench/command.py, imported only when it
runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional, get_args

import typer

from hearth.services.cli_options import configuration_env
from hearth.services.model_options import DeviceOption, DtypeOption, QuantizeOption, TorchThreadsOption
from hearth.protocol.chat import VerifyLevel
from hearth.services.devtools.bench.defaults import (
    default_new_tokens,
    default_prompt_tokens,
    default_repeats,
    default_replicas,
    default_sessions,
)
from hearth.services.devtools.bench.verification_metrics import MIRRORS_PER_CHECK
from hearth.services.devtools.demo import default_shards


def bench_command(
    ctx: typer.Context,
    model: Annotated[
        Optional[str], typer.Option("--model", help="Checkpoint folder, GGUF file (or a folder holding one; its "
                                    "baseline is hearth's one-process path, not generate()), hub id in the local "
                                    "cache, or random:<shape> (llama-250m, tinyllama-1.1b, llama3-8b, tiny) for "
                                    "random weights (default: the bundled model).",
                                    show_default=False)
    ] = None,
    shards: Annotated[int, typer.Option("--shards", min=1, help="Shard processes; the layers are split evenly.")] = \
        default_shards,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", min=1, help="Prompt length in tokens.")] = \
        default_prompt_tokens,
    new_tokens: Annotated[int, typer.Option("--new-tokens", min=2, help="Tokens to generate per request.")] = \
        default_new_tokens,
    sessions: Annotated[int, typer.Option("--sessions", min=1, help="Concurrent sessions (1 skips that part).")] = \
        default_sessions,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Measured rounds of monolithic + pipeline.")] = \
        default_repeats,
    burst: Annotated[int, typer.Option("--burst", min=0, help="Then send this many requests at once: completed and "
                                       "refused, queue wait and time to first token (0 skips it).")] = 0,
    torch_threads: TorchThreadsOption = None,
    monolithic_threads: Annotated[
        Optional[int], typer.Option("--monolithic-threads", min=1, help="torch threads of the generate() baseline "
                                    "(default: the same as --torch-threads).", show_default=False)
    ] = None,
    env: Annotated[
        Optional[list[str]], typer.Option("--env", help="KEY=VALUE for the started processes' environment, e.g. "
                                          "OMP_WAIT_POLICY=ACTIVE (repeatable).", show_default=False)
    ] = None,
    cache_dir: Annotated[
        Optional[Path], typer.Option("--cache-dir", help="Where random:<shape> checkpoints are written "
                                     "(default $HEARTH_CACHE_DIR or ~/.cache/hearth).", show_default=False)
    ] = None,
    work_dir: Annotated[
        Optional[Path], typer.Option("--work-dir", help="Keep the started processes' logs and state here (default: "
                                     "a temporary folder, removed at the end).", show_default=False)
    ] = None,
    library_defaults: Annotated[
        bool, typer.Option("--library-defaults/--no-library-defaults", help="Also time generate() as a plain "
                           "transformers user runs it: no OMP settings, torch's own thread count.")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    insecure: Annotated[bool, typer.Option("--insecure", help="Run the mesh open: no credentials, signatures or "
                                           "activation MACs (to measure what they cost).")] = False,
    metrics: Annotated[bool, typer.Option("--metrics/--no-metrics", help="Run the processes with /metrics on (the "
                                          "per-hop transport figures come from them) or off (to measure what they "
                                          "cost).")] = True,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    pin_cores: Annotated[
        Optional[int], typer.Option("--pin-cores", min=1, help="Instead: N shard processes, each pinned to its own "
                                    "core (taskset) with one torch thread, serving concurrent sessions, vs one "
                                    "process running the whole model on one core (aggregate tokens/s and their "
                                    "ratio to N x that; uses --model, --prompt-tokens, --new-tokens, --repeats, "
                                    "--env, --insecure).", show_default=False)
    ] = None,
    verify: Annotated[
        Optional[str], typer.Option("--verify", help="The verification level every pipeline request asks for: none, "
                                    "sampled, all or vote (default: none asked, the protocol's default applies).",
                                    show_default=False)
    ] = None,
    replicas: Annotated[int, typer.Option("--replicas", help="Shard processes serving each layer range, each on a "
                                          "node of its own (the others check a hop's work: `all` needs 2, `vote` "
                                          "3).")] = default_replicas,
    pin_sessions: Annotated[
        Optional[list[int]], typer.Option("--pin-sessions", min=1, help="With --pin-cores: a number of concurrent "
                                          "sessions to measure (repeatable; default N, 2N, 4N and 8).",
                                          show_default=False)
    ] = None,
) -> None:
    """Monolithic generate() (hearth's one-process path for a GGUF) vs the distributed pipeline on this machine:
    tokens/s, ratio, TTFT, construction, per-hop transport overhead, concurrent sessions, and a burst (--burst); or,
    with --pin-cores N, N pinned shards together vs one process on one core."""
    from hearth.services.devtools.bench.command import BenchOptions, run_bench_command, run_together_command

    child_env = configuration_env(ctx)
    for item in env or []:
        key, separator, value = item.partition("=")
        if not separator or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--env")
        child_env[key] = value
    check_verification_options(verify, replicas, pin_cores=pin_cores)
    if pin_cores is not None:
        from hearth.services.devtools.bench.together import TogetherOptions

        raise typer.Exit(run_together_command(TogetherOptions(
            cores=pin_cores, model=model, sessions=list(pin_sessions or []), prompt_tokens=prompt_tokens,
            new_tokens=new_tokens, repeats=repeats, cache_dir=cache_dir, child_env=child_env, secure=not insecure),
            as_json=as_json))
    if pin_sessions:
        raise typer.BadParameter("only with --pin-cores", param_hint="--pin-sessions")
    options = BenchOptions(model=model, shards=shards, prompt_tokens=prompt_tokens, new_tokens=new_tokens,
                           sessions=sessions, repeats=repeats, torch_threads=torch_threads,
                           monolithic_threads=monolithic_threads, library_defaults_baseline=library_defaults,
                           child_env=child_env, cache_dir=cache_dir, secure=not insecure,
                           metrics=metrics, burst=burst, device=device, dtype=dtype, work_dir=work_dir,
                           quantize=quantize, verify=verify, replicas=replicas)
    raise typer.Exit(run_bench_command(options, as_json=as_json))


def check_verification_options(verify: str | None, replicas: int, *, pin_cores: int | None) -> None:
    """Refuse a `--verify` level the protocol does not know, fewer than one replica, and either with --pin-cores
    (whose mesh serves no replicas), naming the option; warn on stderr when no check can find another replica."""
    levels = get_args(VerifyLevel)
    if verify is not None and verify not in levels:
        raise typer.BadParameter(f"expected one of {', '.join(levels)}, got {verify!r}", param_hint="--verify")
    if replicas < 1:
        raise typer.BadParameter(f"expected at least 1 shard process per layer range, got {replicas}",
                                 param_hint="--replicas")
    if pin_cores is not None and (verify is not None or replicas != 1):
        raise typer.BadParameter("not with --pin-cores", param_hint="--verify" if verify is not None else "--replicas")
    if verify in ("all", "vote") and replicas < 1 + MIRRORS_PER_CHECK[verify]:
        typer.echo(f"hearth bench: --verify {verify} with --replicas {replicas}: no other replica can check a hop, "
                   "so every check counts `no_replica`", err=True)
