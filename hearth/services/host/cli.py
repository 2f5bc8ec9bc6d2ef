"""The `hearth host` command line (its body is hearth/services/host/main.py, imported only when it runs)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from hearth.services.cli_options import (
    MetricsHostOption,
    MetricsPortOption,
    ReadyFileOption,
    CredsOption,
    InsecureOption,
    FINITE_FLOAT_METAVAR,
    finite_between,
    NatsUrlOption,
    WaitForNatsOption,
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
    BusyThreadsOption,
    TorchThreadsOption,
    DeviceOption,
    DtypeOption,
    QuantizeOption,
)

# A bound on `--memory-budget-mb` (about an exabyte): any machine's memory is within it, and "inf" is refused here
# rather than failing as a traceback once the budget is turned into bytes.
MAX_MEMORY_BUDGET_MB = 1e12

# `hearth host --memory-budget-mb` (and `hearth doctor`'s, which checks that it holds a layer).
MemoryBudgetOption = Annotated[Optional[finite_between(0.001, MAX_MEMORY_BUDGET_MB)], typer.Option(
    "--memory-budget-mb", show_default=False, metavar=FINITE_FLOAT_METAVAR,
    help="Memory this host gives the mesh on its device: weights plus [shard] kv_cache_budget_mb, which left at its "
         "default takes at most a quarter of this (default: [shard] max_memory_mb; at most what the device has free "
         "at start).")]


@long_running("hearth host")
def host_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Option("--model", help="Checkpoint folder, GGUF file, ollama:NAME[:TAG] (a model "
                                                       "Ollama pulled here), hub model id or store:NAME (the "
                                                       "community's store: only the layers served are fetched).")],
    memory_budget_mb: MemoryBudgetOption = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    nats_url: NatsUrlOption = None,
    node_id: HostNodeIdOption = None,
    model_id: ModelIdOption = None,
    torch_threads: TorchThreadsOption = None,
    busy_threads: BusyThreadsOption = None,
    ready_file: ReadyFileOption = None,
    metrics_port: MetricsPortOption = 0,
    metrics_host: MetricsHostOption = None,
    wait_for_nats_flag: WaitForNatsOption = False,
    creds: CredsOption = None,
    insecure: InsecureOption = False,
) -> None:
    """Serve the layers of MODEL that fit this host's memory budget and most improve the mesh's coverage
    (least-replicated layers first); move to fill a hole when a host leaves, never dropping a layer's last replica."""
    from hearth.services.common.hearth_files import bundled_model_or
    from hearth.services.common.lifecycle import run_until_stopped
    from hearth.services.host.main import run_host

    model = bundled_model_or(model)
    wait_for_nats(ctx, wait_for_nats_flag)
    use_metrics_host(ctx, metrics_host)
    node_id = node_id_for("hearth host", use_credentials(ctx, "hearth host", creds, insecure), node_id, "shard")
    url = resolve_nats_url(ctx, nats_url)
    run_until_stopped(lambda stop_event: run_host(
        model=model, memory_budget_mb=memory_budget_mb, nats_url=url, settings=settings(ctx), node_id=node_id,
        model_id=model_id, device=device, dtype=dtype, torch_threads=torch_threads, busy_threads=busy_threads,
        ready_file=ready_file, metrics_port=metrics_port, quantize=quantize, stop_event=stop_event,
    ))
