"""`hearth bench --pin-cores N`: N shard processes, each pinned to its own core, serving M concurrent sessions,
against one process that runs the whole model on one core (issue 13, "together faster than alone").

1. Baseline: a worker process (services.devtools.bench.monolithic) under `taskset -c <first core>` with one torch
   thread loads the whole model and times one greedy session both with transformers generate() and with
   hearth's own one-process path (inference.local.LocalModel), ``--repeats`` rounds each, alternating; the
   fastest run of either (end to end: tokens / time from the call to the last token, prefill included;
   decode: (tokens - 1) / first to last token) is the baseline, since neighbours on a shared machine only
   ever slow a run down. The same worker then runs every session's prompt alone (generate()): the solo
   outputs. It stays loaded, idle while the mesh runs, and runs the faster path once more before the first
   mesh run and after each: every mesh run also gets a paired ratio against the two baseline runs around
   it, so that a shared machine's drifting load weighs on both sides alike (the verdict's figure).
2. Mesh: nats-server, N shard processes (layers split evenly), each under `taskset -c <its core>` with one
   intra-op thread, and an orchestrator, all as LocalCluster starts them; nats-server, the orchestrator
   (embedding, logits, sampling) and this client are not pinned, so on a machine with N cores they share
   the shards' cores. The kernel's Cpus_allowed_list of every process is read while they run.
3. For each session count M (default N, 2N, 4N and 8), ``--repeats`` times: M requests with different prompts of
   the same length sent at once. Aggregate end to end = all tokens / wall time from sending the first request
   to the last `done`; decode-only = the tokens that came after every session had its first token / the
   time from then to the last token. Ratio = aggregate / (N x baseline), the same definition on both sides
   (end to end with end to end, decode with decode). Every session's tokens are compared with its solo run,
   and the CPU seconds each process used during the run (/proc/<pid>/stat) are reported per token.
"""

from __future__ import annotations

import asyncio
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hearth.services.devtools.bench.defaults import default_new_tokens, default_prompt_tokens
from hearth.services.devtools.bench.errors import BenchError
from hearth.services.devtools.bench.mesh import one_caller_shard_args, one_caller_streams_env
from hearth.services.devtools.bench.monolithic import MonolithicInfo, MonolithicWorker
from hearth.services.devtools.bench.pipeline import pipeline_generation
from hearth.services.devtools.bench.timing import GenerationTiming
from hearth.services.devtools.bench.process_stats import cpu_seconds, cpus_allowed, own_cpu_seconds
from hearth.services.devtools.bench.runner import bench_step_timeout_s
from hearth.services.devtools.bench.together_report import (
    BaselineFigures,
    PinnedProcess,
    SessionsRun,
    TogetherReport,
    aggregate_rates,
    baseline_figures,
    together_checks,
)
from hearth.services.devtools.local_cluster import LocalCluster, even_layer_ranges
from hearth.services.devtools.core_sharing import quiet_torch_environment
from hearth.services.common.lifecycle import run_event_loop
from hearth.services.devtools.demo import resolve_demo_model
from hearth.services.devtools.random_models import RANDOM_PREFIX, random_checkpoint

warmup_new_tokens = 4
generate_path, local_path = "transformers generate()", "hearth LocalModel"
# Fewer measured rounds than `hearth bench`: each round here runs every session count.
together_repeats = 2
ready_timeout_s = 600.0


@dataclass
class TogetherOptions:
    """What one `hearth bench --pin-cores N` run measures."""

    cores: int
    model: str | None = None
    # Concurrent session counts to measure (empty: N, 2N, 4N and 8).
    sessions: list[int] = field(default_factory=list)
    prompt_tokens: int = default_prompt_tokens
    new_tokens: int = default_new_tokens
    repeats: int = together_repeats
    cache_dir: Path | None = None
    child_env: dict[str, str] = field(default_factory=dict)
    secure: bool = True

    def session_counts(self) -> list[int]:
        return sorted(set(self.sessions or [self.cores, 2 * self.cores, 4 * self.cores, 8]))


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@dataclass
class Baseline:
    """What the one-core baseline gave: its figures, the prompts and every prompt's solo greedy tokens."""

    worker: MonolithicWorker
    texts: list[str]
    solo: list[list[int]]
    sides: list[BaselineFigures]
    pinned: PinnedProcess
    info: MonolithicInfo
    # generate() and hearth's LocalModel gave the same greedy tokens for the first prompt.
    agree: bool

    @property
    def best(self) -> BaselineFigures:
        return max(self.sides, key=lambda side: side.end_to_end_tokens_per_s_best)

    @property
    def rates(self) -> tuple[float, float]:
        """(end to end, decode) tokens/s: the fastest run of either one-process path (the hardest baseline)."""
        return (self.best.end_to_end_tokens_per_s_best, max(side.decode_tokens_per_s_best for side in self.sides))

    @property
    def cpu_ms_per_token(self) -> float:
        """CPU per token of the cheaper path (the hardest baseline for the CPU-time ratio)."""
        return min(side.cpu_ms_per_token for side in self.sides)


def _timed(worker: MonolithicWorker, path: str, text: str, new_tokens: int) -> tuple[GenerationTiming, float]:
    """One greedy run of the baseline worker by `path`, and the CPU seconds the worker used for it."""
    generate = worker.generate if path == generate_path else worker.generate_local
    cpu_before = cpu_seconds(worker.process.pid)
    run = generate(text, new_tokens)
    return run, cpu_seconds(worker.process.pid) - cpu_before


def _load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def available_cores() -> list[int]:
    """The cores this process may run on (its affinity, which a container or taskset may have narrowed)."""
    return sorted(os.sched_getaffinity(0))


class TogetherBench:
    """One `hearth bench --pin-cores N` run; `run()` returns the report."""

    def __init__(self, options: TogetherOptions) -> None:
        self.options = options

    def run(self) -> TogetherReport:
        options = self.options
        available = available_cores()
        if options.cores > len(available):
            raise BenchError(f"--pin-cores {options.cores} needs {options.cores} cores, but this process may run on "
                             f"{len(available)} ({','.join(map(str, available))})")
        cores = available[:options.cores]
        spec = options.model
        if spec is not None and spec.startswith(RANDOM_PREFIX):
            spec = str(random_checkpoint(spec, options.cache_dir))
        model = resolve_demo_model(spec)
        if options.cores > model.num_layers:
            raise BenchError(f"--pin-cores must be at most the model's {model.num_layers} layers")
        started_at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        load_before = _load_average()
        counts = options.session_counts()
        max_streams = max(4, *counts)
        env = {**one_caller_streams_env(max_streams), **options.child_env}
        with LocalCluster(torch_threads=1, extra_env=env, log_level="WARNING", secure=options.secure) as cluster:
            baseline = self._baseline(cluster, model, cores[0], max(counts))
            try:
                self._start_mesh(cluster, model, cores, max_streams)
                report = run_event_loop(self._measure(cluster, model, cores, counts, baseline))
            finally:
                baseline.worker.close()
        report.started_at = started_at
        report.machine.update(load_average_before=load_before, load_average_after=_load_average())
        report.targets = together_checks(report)
        return report

    # -------------------------------------------------------------- baseline

    def _baseline(self, cluster: LocalCluster, model, core: int, prompts: int) -> Baseline:
        options = self.options
        _progress(f"baseline: the whole model in one process on core {core}, one torch thread ...")
        worker = MonolithicWorker(model.path, {**quiet_torch_environment(1), **options.child_env}, 1,
                                  cluster.work_dir / "baseline.log", cpus=[core])
        try:  # it stays loaded (idle) while the mesh runs, for the baseline runs between the mesh's
            info = worker.wait_ready()
            pinned = PinnedProcess(name="baseline (whole model)", pid=worker.process.pid,
                                   cpus_allowed=cpus_allowed(worker.process.pid), pinned_to=[core])
            texts = [worker.prompt(options.prompt_tokens, variant)[0] for variant in range(prompts)]
            worker.generate(texts[0], warmup_new_tokens)
            worker.generate_local(texts[0], warmup_new_tokens)
            runs = {generate_path: [], local_path: []}
            cpu = {path: [] for path in runs}
            for round_index in range(options.repeats):
                order = list(runs) if round_index % 2 == 0 else list(reversed(runs))
                for path in order:
                    run, cpu_s = _timed(worker, path, texts[0], options.new_tokens)
                    cpu[path].append(cpu_s)
                    runs[path].append(run)
                    _progress(f"  {path:24s}: {run.tokens / run.end_s:6.2f} tokens/s end to end, "
                              f"{run.decode_tokens_per_s:6.2f} decode")
            _progress(f"  the {prompts} sessions' prompts alone (generate()), for the outputs ...")
            solo = [runs[generate_path][0].token_ids] + [
                worker.generate(text, options.new_tokens).token_ids for text in texts[1:]]
        except BaseException:
            worker.close()
            raise
        first_tokens = [timings[0].token_ids for timings in runs.values()]
        return Baseline(worker=worker, texts=texts, solo=solo, pinned=pinned, info=info,
                        agree=first_tokens[0] == first_tokens[1],
                        sides=[baseline_figures(path, timings, cpu[path]) for path, timings in runs.items()])

    # -------------------------------------------------------------- mesh

    def _start_mesh(self, cluster: LocalCluster, model, cores: list[int], max_streams: int) -> None:
        ranges = even_layer_ranges(model.num_layers, len(cores))
        _progress(f"mesh: nats-server, {len(ranges)} shards {ranges} pinned to cores {cores}, an orchestrator ...")
        cluster.start_nats()
        for index, ((lo, hi), core) in enumerate(zip(ranges, cores)):
            cluster.start_shard(str(model.path), lo, hi, node_id=f"pinned-{index}", wait_ready=False, cpus=[core],
                                extra_args=one_caller_shard_args(max_streams))
        cluster.start_orchestrator(node_id="bench-orchestrator", wait_ready=False, extra_args=[
            "--preload", str(model.path), "--step-timeout-s", str(bench_step_timeout_s)])
        for process in cluster.processes:
            cluster.wait_ready(process, timeout_s=ready_timeout_s)
        _progress("all processes ready")

    def _watched(self, cluster: LocalCluster, cores: list[int]) -> tuple[list[PinnedProcess], dict[str, int]]:
        """Every process of the mesh as the kernel sees it now, and the pids whose CPU time is counted."""
        pids = {"nats-server": cluster.nats.pid}
        pinned = [PinnedProcess(name="nats-server", pid=cluster.nats.pid, cpus_allowed=cpus_allowed(cluster.nats.pid),
                                pinned_to=None)]
        shard_index = 0
        for process in cluster.processes:
            is_shard = process.name.startswith("shard-")
            name = f"shard {shard_index}" if is_shard else "orchestrator"
            pids[name] = process.popen.pid
            pinned.append(PinnedProcess(name=process.name, pid=process.popen.pid,
                                        cpus_allowed=cpus_allowed(process.popen.pid),
                                        pinned_to=[cores[shard_index]] if is_shard else None))
            shard_index += is_shard
        return pinned, pids

    async def _measure(self, cluster: LocalCluster, model, cores: list[int], counts: list[int],
                       baseline: Baseline) -> TogetherReport:
        from hearth.services.broker.connection import connect_nats

        options = self.options
        model_ref = str(model.path)
        texts, solo, base_rates = baseline.texts, baseline.solo, baseline.rates
        pinned, pids = self._watched(cluster, cores)
        nc = await connect_nats(cluster.nats_url, name="hearth-bench-together", settings=cluster.nats_settings())
        runs = []
        try:
            _progress("warming up the mesh ...")
            await asyncio.gather(*(pipeline_generation(nc, model_ref, text, warmup_new_tokens)
                                   for text in texts[:max(counts)]))
            # A baseline run before the first mesh run and after each, so that each mesh run has one on either
            # side and a shared machine's drifting load weighs on both alike (the paired ratio).
            between = [await self._baseline_between(baseline)]
            for count in counts:
                for repeat in range(options.repeats):
                    run = await self._sessions(nc, model_ref, texts[:count], solo[:count], pids, base_rates,
                                               baseline.cpu_ms_per_token, repeat)
                    between.append(await self._baseline_between(baseline))
                    run.baseline_around = between[-2:]
                    run.paired_ratio = run.aggregate_tokens_per_s / (len(cores) * statistics.mean(between[-2:]))
                    runs.append(run)
                    _progress(f"  {count} sessions #{repeat + 1}: {run.aggregate_tokens_per_s:6.2f} tokens/s "
                              f"aggregate, ratio {run.ratio:.3f} (paired {run.paired_ratio:.3f}), "
                              f"same as solo: {run.outputs_match_solo}")
        finally:
            async with asyncio.timeout(5):
                await nc.close()
        info = baseline.info
        return TogetherReport(
            started_at="",
            machine={"cpu_count": os.cpu_count(), "cpus_available": len(available_cores()), "cores_used": cores,
                     "platform": platform.platform(), "torch": info.torch_version},
            model={"spec": options.model or "bundled", "path": model_ref, "layers": model.num_layers,
                   "parameters": info.parameters, "dtype": info.dtype},
            settings={"layer_ranges": even_layer_ranges(model.num_layers, len(cores)),
                      "prompt_tokens": options.prompt_tokens, "new_tokens": options.new_tokens,
                      "repeats": options.repeats, "sessions": counts, "torch_threads": 1,
                      "child_env": options.child_env, "secure": options.secure},
            pinned=[baseline.pinned, *pinned], baselines=baseline.sides, baseline_used=baseline.best.path,
            baseline_end_to_end_tokens_per_s=base_rates[0], baseline_decode_tokens_per_s=base_rates[1],
            baseline_paths_agree=baseline.agree, baseline_between=between, runs=runs)

    async def _baseline_between(self, baseline: Baseline) -> float:
        """One end-to-end run of the faster baseline path between mesh runs: its tokens/s."""
        run, _ = await asyncio.to_thread(_timed, baseline.worker, baseline.best.path, baseline.texts[0],
                                         self.options.new_tokens)
        return run.tokens / run.end_s

    async def _sessions(self, nc, model_ref: str, texts: list[str], solo: list[list[int]], pids: dict[str, int],
                        base_rates: tuple[float, float], base_cpu_ms: float, repeat: int) -> SessionsRun:
        options = self.options
        cores = sum(name.startswith("shard") for name in pids)
        load = os.getloadavg()[0]
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()} | {"bench client": own_cpu_seconds()}
        started = time.perf_counter()

        async def one(text: str):
            sent = time.perf_counter() - started
            return sent, await pipeline_generation(nc, model_ref, text, options.new_tokens)

        results = await asyncio.gather(*(one(text) for text in texts))
        wall_s = time.perf_counter() - started
        cpu_after = {name: cpu_seconds(pid) for name, pid in pids.items()} | {"bench client": own_cpu_seconds()}
        tokens = sum(timing.tokens for _, timing in results)
        end_to_end, decode = aggregate_rates(results, wall_s)
        cpu_s = {name: round(cpu_after[name] - cpu_before[name], 3) for name in cpu_after}
        mesh_cpu_s = sum(seconds for name, seconds in cpu_s.items() if name != "bench client")
        return SessionsRun(
            sessions=len(texts), repeat=repeat, load_average_1m=round(load, 2), wall_s=wall_s, tokens=tokens,
            aggregate_tokens_per_s=end_to_end, decode_aggregate_tokens_per_s=decode,
            ratio=end_to_end / (cores * base_rates[0]),
            decode_ratio=decode / (cores * base_rates[1]) if decode else None,
            outputs_match_solo=all(timing.token_ids == expected for (_, timing), expected in zip(results, solo)),
            cpu_s=cpu_s, cpu_ms_per_token={name: round(1000 * seconds / tokens, 1) for name, seconds in cpu_s.items()},
            cpu_time_ratio=base_cpu_ms / (1000 * mesh_cpu_s / tokens) if mesh_cpu_s else 0.0,
            mesh_cores_used=mesh_cpu_s / wall_s)
