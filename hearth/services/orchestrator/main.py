"""The `hearth orchestrator` process: connect, run the Orchestrator until SIGINT/SIGTERM, stop cleanly."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from hearth.events.outbox_file import OutboxFileUnavailable
from hearth.events.streams import PIPELINES_STREAM
from hearth.readmodels.db import ReadModelUnusable
from hearth.readmodels.scratch_model import ScratchModelGivenUp
from hearth.services.common.config import HearthSettings
from hearth.services.common.event_trust import broker_clock_watch
from hearth.services.common.hearth_files import state_dir
from hearth.services.common.lifecycle import (CommandInputRefused, CommandRefused, Stopped, unless_stopped,
                                              write_ready_file)
from hearth.services.common.metrics import serve_process_metrics
from hearth.services.broker.connection import connect_nats, drain_or_close
from hearth.services.orchestrator.catalog import LocalModelUnusable, ModelCatalog, UnknownModel, is_hub_id, stored_name
from hearth.services.orchestrator.service import Orchestrator
from hearth.inference.checkpoint import is_local_model
from hearth.inference.devices import resolve_placement
from hearth.inference.errors import InferenceError, first_line
from hearth.inference.loading import check_checkpoint
from hearth.inference.quantization import QuantizationError, check_device_supports, parse_quantization
from hearth.protocol.quantization_labels import AUTO_QUANTIZATION

# What an orchestrator's clock beyond [events] max_clock_skew_s of the broker's does (hearth/events/broker_clock.py).
ORCHESTRATOR_CLOCK_CONSEQUENCE = ("members' calls are refused as stale and shards refuse its opens; ahead, its "
                                  "pipeline events are rejected (future_dated) and every shard reads as not heard "
                                  "from")


@dataclass(frozen=True)
class OrchestratorOptions:
    """What the command line says beyond the settings."""

    node_id: str
    db_path: Path | None = None
    model_search_dirs: tuple[Path, ...] = ()
    local_model: str | None = None
    # Intra-op threads per step while several calls run (inference.compute_thread.StepThreads).
    busy_threads: int | None = None
    # --metrics-port: 0 serves no /metrics (and skips per-step observations); None leaves metrics as they are.
    metrics_port: int | None = None
    # Where the heads compute (None: [research.distributed_inference.host] device and dtype).
    device: str | None = None
    dtype: str | None = None
    # How the head's and the local model's weights are held (None: [research.distributed_inference.host] quantize).
    quantize: str | None = None


def with_step_timeout(settings: HearthSettings, step_timeout_s: float | None) -> HearthSettings:
    """The settings with `--step-timeout-s` in place of `[transport] step_timeout_s` when given."""
    if step_timeout_s is None:
        return settings
    transport = settings.transport.model_copy(update={"step_timeout_s": step_timeout_s})
    return settings.model_copy(update={"transport": transport})


def refusal_of(spec: str, line: str) -> CommandRefused:
    """The one line refusing a model the command line named: the caller's input (exit 2, CommandInputRefused) for a
    model of this machine, as `hearth host` and `hearth shard` refuse theirs; exit 1 for one fetched from elsewhere
    (a hub id, `store:NAME`), which may fail for now (the network, the broker)."""
    return CommandInputRefused(line) if is_local_model(spec) else CommandRefused(line)


def check_local_model(options: OrchestratorOptions) -> None:
    """Refuse a --local-model that is not there or whose config does not read or names a family hearth does not
    serve, reading no weight: loaded only when first needed, it would otherwise be listed by llm.models and fail
    then (refusal_of: exit 2 for a path of this machine). A `store:NAME` model, or a hub id not in the local hub
    cache, is fetched in the background from the start instead, and listed once it has arrived
    (hearth/services/orchestrator/local_fetch.py)."""
    spec = options.local_model
    if spec is None:
        return
    try:
        if stored_name(spec) is not None:
            return
        path = ModelCatalog(list(options.model_search_dirs), spec).resolve(spec)
        check_checkpoint(path)
    except UnknownModel as error:
        if not is_hub_id(spec):  # neither a hub id nor found here: the name of a model of this machine, mistyped
            raise CommandInputRefused(f"--local-model {spec}: {first_line(error)}") from None
    except InferenceError as error:
        raise refusal_of(spec, f"--local-model {spec}: {first_line(error)}") from None


def check_local_preloads(options: OrchestratorOptions, preload: list[str]) -> None:
    """Refuse, before the broker is dialled and reading no weight, a --preload of this machine (a path, a GGUF file,
    an Ollama model) that is not there or is no checkpoint hearth serves: the caller's input, exit 2, as `hearth host`
    refuses its --model. Those fetched from elsewhere are refused when preloaded (refusal_of)."""
    for model in preload:
        if not is_local_model(model):
            continue
        try:
            check_checkpoint(ModelCatalog(list(options.model_search_dirs)).resolve(model))
        except UnknownModel as error:  # the words the preload itself would refuse it with
            raise CommandInputRefused(f"--preload: {first_line(error)}") from None
        except InferenceError as error:
            raise CommandInputRefused(f"--preload {model}: {first_line(error)}") from None


async def run_orchestrator(settings: HearthSettings, options: OrchestratorOptions, nats_url: str | None, *,
                           preload: list[str] = (), ready_file: str | None = None,
                           stop_event: asyncio.Event) -> None:
    host = settings.research.distributed_inference.host
    try:  # before connecting: a bad option is one line, whether or not a broker is reachable
        device, dtype = resolve_placement(options.device or host.device, options.dtype or host.dtype)
        quantize = options.quantize or host.quantize  # auto: resolved per model as its head loads
        if quantize != AUTO_QUANTIZATION:
            check_device_supports(parse_quantization(quantize), device)
    except QuantizationError as error:  # the caller's input, as for `hearth host` and `hearth shard`: exit 2
        raise CommandInputRefused(f"--quantize: {error}") from None
    except ValueError as error:
        raise CommandInputRefused(str(error)) from None
    await asyncio.to_thread(check_local_model, options)  # reads config and headers: off the event loop
    await asyncio.to_thread(check_local_preloads, options, preload)
    nc = await unless_stopped(
        connect_nats(nats_url, name=f"hearth-orchestrator {options.node_id}", settings=settings.nats), stop_event)
    orchestrator = Orchestrator(nc, settings, node_id=options.node_id, db_path=options.db_path,
                                model_search_dirs=list(options.model_search_dirs), local_model=options.local_model,
                                busy_threads=options.busy_threads,
                                outbox_dir=settings.orchestrator.event_outbox_dir or state_dir("event-outbox"))
    orchestrator.catalog.use_compute(device, dtype, quantization=quantize)
    orchestrator.catalog.use_store(nc.jetstream())  # `store:NAME` models come through this connection
    metrics_server = None
    clock_watch = broker_clock_watch(nc, settings, PIPELINES_STREAM, f"orchestrator {options.node_id}",
                                     ORCHESTRATOR_CLOCK_CONSEQUENCE)
    try:
        metrics_server = serve_process_metrics(options.metrics_port, f"orchestrator {options.node_id}",
                                               host=settings.metrics.host)
        if clock_watch is not None:
            clock_watch.start()
        try:
            await orchestrator.start()
        except ReadModelUnusable as error:  # --db a folder, a damaged file: one line, the file left as it was
            raise CommandRefused(f"--db {error}") from None
        except ScratchModelGivenUp as error:  # no --db, and the disk damages every file written there
            raise CommandRefused(str(error)) from None
        except OutboxFileUnavailable as error:
            raise CommandRefused(f"{error} (give [orchestrator] event_outbox_dir, "
                                 "HEARTH_ORCHESTRATOR__EVENT_OUTBOX_DIR, a folder this process may write)") from None
        await orchestrator.catalog.start_local_fetch()  # listed by llm.models once it has arrived
        for model in preload:
            try:
                await orchestrator.catalog.preload(model)
            except InferenceError as error:  # a checkpoint it cannot serve: one line, not a traceback
                raise refusal_of(model, f"--preload {model}: {first_line(error)}") from None
            except UnknownModel as error:  # no such path, several GGUFs, a name the store lacks: its message names it
                raise refusal_of(model, f"--preload: {first_line(error)}") from None
            except LocalModelUnusable as error:
                raise refusal_of(str(options.local_model), f"--local-model {options.local_model}: {error}") from None
        print(f"orchestrator {options.node_id} ready", flush=True)
        if ready_file:
            write_ready_file(ready_file, options.node_id)
        try:  # until stopped, or until its read model can no longer be kept: routing on it would go stale, so one line
            ending = await unless_stopped(orchestrator.read_model_failed(), stop_event)
        except Stopped:
            return
        raise CommandRefused(ending)
    finally:
        if clock_watch is not None:
            await clock_watch.stop()
        if metrics_server is not None:
            metrics_server.stop()
        await orchestrator.stop()
        await drain_or_close(nc, settings.nats.drain_timeout_s)
