"""The Bench: starts the cluster and the generate() workers, runs the timed rounds and the concurrent sessions, and
assembles the report (hearth/services/devtools/bench/__init__.py describes the whole measurement)."""

from __future__ import annotations

import asyncio
import functools
import os
import platform
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from hearth.services.devtools.bench.burst import run_burst
from hearth.services.devtools.bench.defaults import (
    default_new_tokens,
    default_prompt_tokens,
    default_repeats,
    default_replicas,
    default_sessions,
)
from hearth.services.devtools.bench.errors import BenchError
from hearth.services.devtools.bench.mesh import BenchMesh, bench_cluster_env, start_bench_mesh, wait_mesh_ready
from hearth.services.devtools.bench.monolithic import MonolithicWorker
from hearth.services.devtools.bench.pipeline import pipeline_generation
from hearth.services.devtools.bench.process_stats import shard_imports_memory
from hearth.services.devtools.bench.report import (
    BenchReport,
    ConcurrentFigures,
    ImportsMemory,
    SessionFigures,
    shard_memory_figures,
    side_figures,
    with_resident_memory,
)
from hearth.services.devtools.bench.targets import target_checks
from hearth.services.devtools.bench.timing import GenerationTiming, tokens_before_divergence
from hearth.services.devtools.bench.token_budget import parse_orchestrator_timings, token_budget
from hearth.services.devtools.bench.verification_metrics import checks_between, parse_verification_checks
from hearth.services.devtools.bench.transport_metrics import (
    Histogram,
    cache_event_counts,
    fetch_metrics_text,
    histogram_deltas,
    mean_batch_rows,
    scrape_hosts,
    transport_figures,
)
from hearth.services.devtools.local_cluster import LocalCluster, even_layer_ranges
from hearth.protocol.chat import ChatParams
from hearth.protocol.quantization_labels import AUTO_QUANTIZATION
from hearth.services.devtools.core_sharing import quiet_torch_environment
from hearth.services.common.lifecycle import run_event_loop
from hearth.services.devtools.demo import default_shards, resolve_demo_model
from hearth.services.devtools.random_models import RANDOM_PREFIX, random_checkpoint

HopValue = TypeVar("HopValue")

# The warm-up generates as many tokens as a measured round: on a GPU, generate()'s first pass over each cache
# length is slow, so a shorter warm-up leaves the first measured round far below the others.
# Generous: this measures speed, not failover; a 1.1B prefill queued behind three others on two busy
# cores can hold a hop for longer than the production default of 10 s.
bench_step_timeout_s = 120.0


@dataclass
class BenchOptions:
    """What one `hearth bench` run measures and how (the command's options)."""

    model: str | None = None
    shards: int = default_shards
    prompt_tokens: int = default_prompt_tokens
    new_tokens: int = default_new_tokens
    sessions: int = default_sessions
    repeats: int = default_repeats
    torch_threads: int | None = None
    # None: the same as torch_threads (the baseline gets the shard processes' thread settings).
    monolithic_threads: int | None = None
    # Also time generate() as a plain transformers user runs it (no OMP settings, torch's thread count).
    library_defaults_baseline: bool = True
    child_env: dict[str, str] = field(default_factory=dict)
    cache_dir: Path | None = None
    # Where the started processes log (None: a temporary folder LocalCluster removes).
    work_dir: Path | None = None
    step_timeout_s: float = bench_step_timeout_s
    # False: an open mesh with no credentials, signatures or activation MACs, to measure what security costs.
    secure: bool = True
    # False: every process runs with --metrics-port 0 (no /metrics, no per-step observations), to measure what
    # metrics cost; the per-hop transport figures, read from the shards' metrics, are then left out.
    metrics: bool = True
    # Requests sent at once after the other parts (0: none), to measure admission.
    burst: int = 0
    # Where and in what dtype shards, orchestrator and generate() compute (None: the CPU defaults of before).
    device: str | None = None
    dtype: str | None = None
    # How shards, the orchestrator's head and generate()'s layers hold their weights (None: full precision).
    quantize: str | None = None
    # The verification level every pipeline request asks for (None: none asked, the protocol's default applies).
    verify: str | None = None
    # Shard processes serving each layer range (the others check a hop's work on `verify`'s steps).
    replicas: int = default_replicas

    @property
    def verify_level(self) -> str:
        """The level the pipeline requests run at."""
        return self.verify or ChatParams.model_fields["verify"].default

    def placement_args(self) -> list[str]:
        return [*(["--device", self.device] if self.device else []), *(["--dtype", self.dtype] if self.dtype else []),
                # Stated, not left to the configuration: the one-process baseline resolves the same setting.
                "--quantize", self.quantize or AUTO_QUANTIZATION]


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


class Bench:
    """One `hearth bench` run with its options; `run()` returns the report."""

    def __init__(self, options: BenchOptions) -> None:
        self.options = options

    def run(self) -> BenchReport:
        options = self.options
        spec = options.model
        if spec is not None and spec.startswith(RANDOM_PREFIX):
            spec = str(random_checkpoint(spec, options.cache_dir))
        resolved = resolve_demo_model(spec)
        if not 1 <= options.shards <= resolved.num_layers:
            raise BenchError(f"--shards must be between 1 and the model's {resolved.num_layers} layers")
        started_at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        load_before = _load_average()
        max_streams = max(4, options.sessions)
        process_env = {**quiet_torch_environment(options.torch_threads), **options.child_env}
        env = bench_cluster_env(max_streams, secure=options.secure, child_env=options.child_env)
        with LocalCluster(work_dir=options.work_dir, torch_threads=options.torch_threads, extra_env=env,
                          log_level="WARNING", secure=options.secure, metrics=options.metrics) as cluster:
            shard_env = cluster.shared_machine_shard_env(None, options.device)
            mesh = start_bench_mesh(cluster, resolved, shards=options.shards, replicas=options.replicas,
                                    max_streams=max_streams, step_timeout_s=options.step_timeout_s,
                                    placement_args=options.placement_args())
            monolithic_threads = options.monolithic_threads or options.torch_threads
            baseline = "hearth's one-process path" if resolved.is_gguf else "generate()"
            _progress(f"loading the whole model for {baseline} in a worker process ({resolved.path}) ...")
            worker = MonolithicWorker(resolved.path, process_env, monolithic_threads,
                                      cluster.work_dir / "monolithic.log", device=options.device, dtype=options.dtype,
                                      quantize=options.quantize)
            # What a plain transformers user gets: this shell's environment, torch's own thread count.
            defaults_worker = MonolithicWorker(resolved.path, {}, None, cluster.work_dir / "monolithic-defaults.log",
                                               device=options.device, dtype=options.dtype,
                                               quantize=options.quantize) \
                if options.library_defaults_baseline else None
            workers = [w for w in (worker, defaults_worker) if w is not None]

            def interrupt(signum, frame) -> None:
                # A generate() in a worker would keep asyncio.run's shutdown waiting for its thread.
                for each in workers:
                    each.kill()
                raise KeyboardInterrupt

            previous_handlers = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGINT, signal.SIGTERM)}
            try:
                for each in workers:
                    each.wait_ready()
                wait_mesh_ready(cluster)
                report = run_event_loop(self._measure(cluster, resolved, worker, defaults_worker, mesh))
            finally:
                for signum, handler in previous_handlers.items():
                    signal.signal(signum, handler)
                for each in workers:
                    each.close()
        report.started_at = started_at
        report.settings["process_env"] = process_env
        report.settings["shard_env"] = shard_env  # what LocalCluster adds for shards sharing the cores
        report.settings["monolithic_torch_threads"] = worker.info.torch_threads if worker.info else None
        report.settings["monolithic_baseline"] = worker.info.baseline if worker.info else None
        if defaults_worker is not None and defaults_worker.info is not None:
            report.settings["library_defaults_torch_threads"] = defaults_worker.info.torch_threads
            report.settings["library_defaults_env"] = {key: value for key, value in os.environ.items()
                                                       if key.startswith(("OMP_", "GOMP_", "KMP_", "MKL_"))}
        report.machine["load_average_before"] = load_before
        report.machine["load_average_after"] = _load_average()
        report.targets = target_checks(report)
        return report

    # -------------------------------------------------------------- measuring

    async def _measure(self, cluster, model, worker: MonolithicWorker, defaults_worker: MonolithicWorker | None,
                       mesh: BenchMesh) -> BenchReport:
        from hearth.services.broker.connection import connect_nats

        options = self.options
        metrics_urls, hop_of, pid_of = mesh.metrics_urls, mesh.hop_of, mesh.pid_of
        generation = functools.partial(pipeline_generation, verify=options.verify)
        model_ref = str(model.path)
        prompt, prompt_ids = await asyncio.to_thread(worker.prompt, options.prompt_tokens)
        nc = await connect_nats(cluster.nats_url, name="hearth-bench", settings=cluster.nats_settings())
        try:
            _progress("warming up both ...")
            await asyncio.to_thread(worker.generate, prompt, options.new_tokens)
            if defaults_worker is not None:
                await asyncio.to_thread(defaults_worker.generate, prompt, options.new_tokens)
            await generation(nc, model_ref, prompt, options.new_tokens)
            before = await scrape_hosts(metrics_urls)
            checks_before, timings_before = await self._orchestrator_figures(mesh)
            mono_runs, pipe_runs, defaults_runs = [], [], []
            sides = ["monolithic", "pipeline"] + (["library defaults"] if defaults_worker is not None else [])
            for round_index in range(options.repeats):
                # Rotate which side goes first, so drifting machine load hits all alike.
                order = sides[round_index % len(sides):] + sides[:round_index % len(sides)]
                for which in order:
                    if which == "monolithic":
                        run = await asyncio.to_thread(worker.generate, prompt, options.new_tokens)
                        mono_runs.append(run)
                    elif which == "library defaults":
                        run = await asyncio.to_thread(defaults_worker.generate, prompt, options.new_tokens)
                        defaults_runs.append(run)
                    else:
                        run = await generation(nc, model_ref, prompt, options.new_tokens)
                        pipe_runs.append(run)
                    _progress(f"  round {round_index + 1}/{options.repeats} {which:16s}: "
                              f"{run.decode_tokens_per_s:7.2f} tokens/s, ttft {run.ttft_ms:7.1f} ms"
                              + (f", construct {run.construct_ms:.1f} ms" if run.construct_ms is not None else ""))
            after = await scrape_hosts(metrics_urls)
            checks_after, timings_after = await self._orchestrator_figures(mesh)
            delta = histogram_deltas(after.histograms, before.histograms)
            concurrent = None
            if options.sessions > 1:
                concurrent = await self._concurrent(nc, model_ref, worker, metrics_urls, hop_of,
                                                    statistics.median(r.decode_tokens_per_s for r in pipe_runs),
                                                    statistics.median(r.end_s for r in pipe_runs))
            burst = None
            if options.burst:
                _progress(f"a burst of {options.burst} requests sent at once ...")
                burst = await run_burst(nc, model_ref, prompt, options.burst, options.new_tokens,
                                        pipe_runs[0].token_ids, verify=options.verify)
            shard_memory = with_resident_memory(await shard_memory_figures(nc), pid_of)
            _progress("the resident memory of a shard's imports alone ...")
            imports = await asyncio.to_thread(shard_imports_memory)
        finally:
            async with asyncio.timeout(5):
                await nc.close()
        mono, pipe = side_figures(mono_runs), side_figures(pipe_runs)
        ratios = [p.decode_tokens_per_s / m.decode_tokens_per_s for p, m in zip(pipe_runs, mono_runs)]
        constructs = sorted(r.construct_ms for r in pipe_runs if r.construct_ms is not None)
        transport_decode = transport_figures(delta, "decode", hop_of)
        info = worker.info
        return BenchReport(
            started_at="",
            machine={"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                     "torch": info.torch_version},
            model={"spec": options.model or "bundled", "path": str(model.path), "layers": model.num_layers,
                   "parameters": info.parameters, "dtype": info.dtype},
            settings={"device": options.device or "cpu", "dtype": options.dtype or "checkpoint's",
                      "quantization": info.quantization,
                      "shards": options.shards, "layer_ranges": even_layer_ranges(model.num_layers, options.shards),
                      "prompt_tokens": len(prompt_ids), "new_tokens": options.new_tokens, "repeats": options.repeats,
                      "sessions": options.sessions, "process_torch_threads": options.torch_threads,
                      "step_timeout_s": options.step_timeout_s, "metrics": options.metrics,
                      "verify": options.verify_level, "replicas": options.replicas},
            monolithic=mono,
            pipeline=pipe,
            greedy_outputs_match=all(r.token_ids == mono_runs[0].token_ids
                                     for r in [*mono_runs, *pipe_runs, *defaults_runs]),
            greedy_tokens_agreeing=tokens_before_divergence(
                [r.token_ids for r in [*mono_runs, *pipe_runs, *defaults_runs]], mono_runs[0].token_ids),
            monolithic_library_defaults=side_figures(defaults_runs) if defaults_runs else None,
            ratio_vs_library_defaults=statistics.median(
                p.decode_tokens_per_s / d.decode_tokens_per_s for p, d in zip(pipe_runs, defaults_runs))
            if defaults_runs else None,
            ratio_median=statistics.median(ratios),
            ratio_of_medians=pipe.decode_tokens_per_s_median / mono.decode_tokens_per_s_median,
            pipeline_overhead_ms_per_token=1000.0 / pipe.decode_tokens_per_s_median
            - 1000.0 / mono.decode_tokens_per_s_median,
            construct_ms_p50=statistics.median(constructs) if constructs else None,
            construct_ms_max=constructs[-1] if constructs else None,
            transport_decode=transport_decode,
            token_budget=token_budget(pipe.decode_tokens_per_s_median, transport_decode, timings_after,
                                      timings_before),
            transport_prefill=transport_figures(delta, "prefill", hop_of),
            concurrent=concurrent,
            targets=[],
            burst=burst,
            shard_memory=shard_memory,
            shard_imports_memory=None if imports is None else ImportsMemory(
                rss_mb=imports.rss_mb, rss_anonymous_mb=imports.anonymous_mb, rss_file_mb=imports.file_mb),
            verification_checks=None if checks_before is None or checks_after is None
            else checks_between(checks_after, checks_before),
        )

    @staticmethod
    async def _orchestrator_figures(mesh: BenchMesh) -> tuple[dict[str, float] | None, dict[str, Histogram] | None]:
        """The orchestrator's verification counter and its turn and head-step histograms now, from one scrape of its
        /metrics (None, None with metrics off)."""
        if mesh.orchestrator_metrics_url is None:
            return None, None
        text = await asyncio.to_thread(fetch_metrics_text, mesh.orchestrator_metrics_url)
        return parse_verification_checks(text), parse_orchestrator_timings(text)

    async def _concurrent(self, nc, model_ref, worker: MonolithicWorker, metrics_urls, hop_of,
                          single_decode_tps: float, single_end_s: float) -> ConcurrentFigures:
        options = self.options
        prompts = [(await asyncio.to_thread(worker.prompt, options.prompt_tokens, i + 1))[0]
                   for i in range(options.sessions)]
        _progress(f"{options.sessions} concurrent sessions ...")
        before = await scrape_hosts(metrics_urls)
        started = time.perf_counter()

        async def one(prompt: str) -> tuple[float, GenerationTiming]:
            sent = time.perf_counter() - started
            return sent, await pipeline_generation(nc, model_ref, prompt, options.new_tokens, verify=options.verify)

        results = await asyncio.gather(*(one(prompt) for prompt in prompts))
        wall_s = time.perf_counter() - started
        after = await scrape_hosts(metrics_urls)
        delta = histogram_deltas(after.histograms, before.histograms)
        first_at = [sent + timing.token_times_s[0] for sent, timing in results]
        done_at = [sent + timing.end_s for sent, timing in results]
        sessions = []
        for index, (sent, timing) in enumerate(results):
            others_done = [done_at[j] for j in range(len(results)) if j != index]
            sessions.append(SessionFigures(
                session=index, tokens=timing.tokens, ttft_ms=timing.ttft_ms, finished_ms=timing.end_s * 1000.0,
                first_token_after_another_finished=any(done <= first_at[index] for done in others_done)))
            _progress(f"  session {index}: ttft {timing.ttft_ms:8.1f} ms, finished after {timing.end_s:6.2f} s, "
                      f"{timing.tokens} tokens")
        total_tokens = sum(timing.tokens for _, timing in results)
        _progress("  each session's prompt alone through generate(), for its tokens ...")
        solo = [await asyncio.to_thread(worker.generate, prompt, options.new_tokens) for prompt in prompts]
        return ConcurrentFigures(
            sessions=sessions, wall_s=wall_s, aggregate_tokens_per_s=total_tokens / wall_s,
            single_session_decode_tokens_per_s=single_decode_tps,
            single_session_end_to_end_tokens_per_s=options.new_tokens / single_end_s,
            transport=transport_figures(delta, "decode", hop_of),
            all_decoding_tokens_per_s=all_decoding_rate([[sent + at for at in timing.token_times_s]
                                                         for sent, timing in results]),
            mean_batch_rows=_by_hop(mean_batch_rows(after.batching, before.batching), hop_of),
            mean_prefill_batch_rows=_by_hop(mean_batch_rows(after.prefill_batching, before.prefill_batching), hop_of),
            cache_events=_by_hop(cache_event_counts(after.cache_events, before.cache_events), hop_of),
            outputs_match_solo=all(timing.token_ids == alone.token_ids
                                   for (_, timing), alone in zip(results, solo, strict=True)),
            solo_tokens_agreeing=min(tokens_before_divergence([timing.token_ids], alone.token_ids)
                                     for (_, timing), alone in zip(results, solo, strict=True)),
        )


def _by_hop(per_shard: dict[str, HopValue], hop_of: dict[str, int]) -> dict[str, HopValue]:
    return dict(sorted(per_shard.items(), key=lambda item: hop_of.get(item[0], 0)))


def all_decoding_rate(token_times_s: list[list[float]]) -> float | None:
    """Tokens/s from the moment every session had its first token to the last token (None: no such span)."""
    all_started = max(times[0] for times in token_times_s)
    later = [at for times in token_times_s for at in times if at > all_started]
    if not later or max(later) <= all_started:
        return None
    return len(later) / (max(later) - all_started)
