"""Measures what checking shard hosts' work costs, and that honest replicas raise no false alarm (BENCHMARKS.md,
"Honest shards: what checks cost"); prints one summary on stdout (--json: one JSON object), progress on stderr.

Real processes on this machine (services.devtools.bench.mesh): nats-server, `--shards` layer ranges each served by
several shard processes (replicas, each on a node of its own), an orchestrator; a secure community mesh.

cost: one mesh with `--cost-replicas` per range (default: enough for the most demanding level measured, 3 with
`vote`, else 2, so that `sampled` finds a replica too); after a warm-up call per level, `--rounds` rounds each make
one call (one session, the same prompt, greedy, `--new-tokens`) per level in `--levels`, the order rotated every
round so drifting load hits all alike. Per level: decode tokens/s of each call (hearth/services/devtools/bench/timing.py),
the median over rounds of its ratio to `none` in the same round, and the checks the orchestrator counted
(`hearth_verification_checks_total`).

false alarms: an honest mesh with `--alarm-replicas` per range; waves of `--sessions` concurrent calls (different
prompts, so the shards batch their steps) at `verify=all`, every hop-step checked on another replica, until
`--target-checks` hop-steps were checked or `--budget-s` passed. Reports the hop-steps checked (from the counter:
`confirmed` counts the hop and its mirror, so two per clean check), mismatches and disputes (target 0), the shards'
mean decode batch, and calls whose tokens differ from the same prompt's alone at `verify=none`.

Usage: .venv/bin/python scripts/bench_verification.py [--part cost|false-alarms|both] [--model random:llama-250m]
       [--shards 3] [--levels none,sampled,all,vote] [--rounds 6] [--new-tokens 64] [--sessions 4]
       [--target-checks 10000] [--budget-s 600] [--sample-rate R] [--torch-threads N] [--dtype D] [--quantize S] [--cores-per-replica C]
       [--json]

On one machine whose cores every process shares, a mirror's work competes with the call's own hops, which it would
not do on a mesh where each replica is a machine of its own: `--cores-per-replica C` pins each replica's shards to C
cores of their own (the orchestrator and nats-server run anywhere).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import get_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hearth.protocol.chat import VerifyLevel  # noqa: E402
from hearth.services.common.config_processes import VerificationSettings  # noqa: E402
from hearth.services.common.lifecycle import run_event_loop  # noqa: E402
from hearth.services.devtools.bench.errors import BenchError  # noqa: E402
from hearth.services.devtools.bench.mesh import (BenchMesh, bench_cluster_env, start_bench_mesh,  # noqa: E402
                                          wait_mesh_ready)
from hearth.services.devtools.bench.pipeline import pipeline_generation  # noqa: E402
from hearth.services.devtools.bench.prompts import build_prompt  # noqa: E402
from hearth.services.devtools.bench.runner import bench_step_timeout_s  # noqa: E402
from hearth.services.devtools.bench.transport_metrics import mean_batch_rows, scrape_hosts  # noqa: E402
from hearth.services.devtools.bench.verification_metrics import (MIRRORS_PER_CHECK, checks_between,  # noqa: E402
                                                          checks_with_verdict, scrape_verification_checks)
from hearth.services.devtools.demo import resolve_demo_model  # noqa: E402
from hearth.services.devtools.local_cluster import LocalCluster  # noqa: E402
from hearth.services.devtools.random_models import RANDOM_PREFIX, random_checkpoint  # noqa: E402

LEVELS = get_args(VerifyLevel)


@dataclass
class LevelCost:
    level: str
    decode_tokens_per_s: list[float] = field(default_factory=list)
    decode_tokens_per_s_median: float = 0.0
    ratio_to_none_median: float | None = None
    ratio_to_none: list[float] = field(default_factory=list)
    checks: dict[str, int] = field(default_factory=dict)
    checks_per_call: float = 0.0


@dataclass
class FalseAlarms:
    replicas: int
    sessions: int
    calls: int = 0
    waves: int = 0
    seconds: float = 0.0
    hop_steps_checked: int = 0
    # What the calls asked for: every hop of every step (a prefill and new_tokens - 1 decode steps per call).
    hop_steps_run: int = 0
    checks: dict[str, int] = field(default_factory=dict)
    false_alarms: int = 0
    mean_decode_batch_rows: dict[str, float] = field(default_factory=dict)
    answers_differing_from_alone: int = 0


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def prompt_texts(model_path: Path, prompt_tokens: int, count: int) -> list[str]:
    """`count` different raw prompts of `prompt_tokens` tokens (exactly, for random checkpoints)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return [build_prompt(tokenizer, model_path, prompt_tokens, variant)[0] for variant in range(count)]


class VerificationBench:
    """One run of the script with its arguments; `run()` returns the summary as a dict."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        spec = args.model
        if spec.startswith(RANDOM_PREFIX):
            spec = str(random_checkpoint(spec, args.cache_dir))
        self.model = resolve_demo_model(spec)

    def run(self) -> dict:
        args = self.args
        summary = {"started_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                   "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                               "load_average_before": _load_average()},
                   "model": {"spec": args.model, "layers": self.model.num_layers},
                   "settings": {"shards": args.shards, "prompt_tokens": args.prompt_tokens,
                                "cores_per_replica": args.cores_per_replica, "dtype": args.dtype,
                                "quantize": args.quantize,
                                "new_tokens": args.new_tokens,
                                "sample_rate": args.sample_rate if args.sample_rate is not None
                                else VerificationSettings.model_fields["sample_rate"].default,
                                "torch_threads": args.torch_threads}}
        if args.part in ("cost", "both"):
            summary["cost"] = [asdict(level) for level in self._on_mesh(args.cost_replicas, 1, self._cost)]
            summary["cost_replicas"] = args.cost_replicas
        if args.part in ("false-alarms", "both"):
            summary["false_alarms"] = asdict(self._on_mesh(args.alarm_replicas, args.sessions, self._false_alarms))
        summary["machine"]["load_average_after"] = _load_average()
        return summary

    def _on_mesh(self, replicas: int, sessions: int, measure):
        """Start a mesh with `replicas` per range, run `measure(nc, mesh, model_ref)` on it, stop it."""
        args = self.args
        max_streams = max(4, sessions)
        env = bench_cluster_env(max_streams, secure=True, child_env={
            **({"HEARTH_VERIFICATION__SAMPLE_RATE": repr(args.sample_rate)} if args.sample_rate is not None else {})})
        with LocalCluster(work_dir=args.work_dir, torch_threads=args.torch_threads, extra_env=env,
                          log_level="WARNING", secure=True) as cluster:
            mesh = start_bench_mesh(cluster, self.model, shards=args.shards, replicas=replicas,
                                    max_streams=max_streams, step_timeout_s=bench_step_timeout_s,
                                    placement_args=placement_args(args),
                                    cores_per_replica=args.cores_per_replica)
            if mesh.orchestrator_metrics_url is None:
                raise BenchError("the orchestrator serves no /metrics: the checks cannot be counted")
            wait_mesh_ready(cluster)
            return run_event_loop(self._connected(cluster, mesh, measure))

    async def _connected(self, cluster: LocalCluster, mesh: BenchMesh, measure):
        from hearth.services.broker.connection import connect_nats

        nc = await connect_nats(cluster.nats_url, name="hearth-bench-verification", settings=cluster.nats_settings())
        try:
            return await measure(nc, mesh, str(self.model.path))
        finally:
            await asyncio.wait_for(nc.close(), timeout=5)

    async def _checks(self, mesh: BenchMesh) -> dict[str, float]:
        return await asyncio.to_thread(scrape_verification_checks, mesh.orchestrator_metrics_url)

    async def _warm_up(self, nc, mesh: BenchMesh, model_ref: str, prompt: str, level: str) -> None:
        """One call at `level`; at a checking level, again until its checks found the replicas (the orchestrator
        learns of them from their advertisements)."""
        for attempt in range(10):
            before = await self._checks(mesh)
            await pipeline_generation(nc, model_ref, prompt, self.args.new_tokens, verify=level)
            delta = checks_between(await self._checks(mesh), before)
            if level not in ("all", "vote") or delta["no_replica"] == 0:
                return
            _progress(f"  warm-up at {level}: {delta['no_replica']} checks found no replica yet; again")
            await asyncio.sleep(1.0 + attempt)
        raise BenchError(f"the calls at {level} found no replica to check on after 10 warm-up calls")

    async def _cost(self, nc, mesh: BenchMesh, model_ref: str) -> list[LevelCost]:
        args = self.args
        (prompt,) = await asyncio.to_thread(prompt_texts, self.model.path, args.prompt_tokens, 1)
        _progress("cost: warming up every level ...")
        for level in args.levels:
            await self._warm_up(nc, mesh, model_ref, prompt, level)
        costs = {level: LevelCost(level) for level in args.levels}
        for round_index in range(args.rounds):
            shift = round_index % len(args.levels)
            for level in args.levels[shift:] + args.levels[:shift]:
                before = await self._checks(mesh)
                run = await pipeline_generation(nc, model_ref, prompt, args.new_tokens, verify=level)
                delta = checks_between(await self._checks(mesh), before)
                cost = costs[level]
                cost.decode_tokens_per_s.append(run.decode_tokens_per_s)
                cost.checks = {outcome: cost.checks.get(outcome, 0) + count for outcome, count in delta.items()}
                _progress(f"  round {round_index + 1}/{args.rounds} {level:8s}: {run.decode_tokens_per_s:7.2f} "
                          f"tokens/s, checks {delta}")
        baseline = costs["none"].decode_tokens_per_s
        for cost in costs.values():
            cost.decode_tokens_per_s_median = statistics.median(cost.decode_tokens_per_s)
            cost.ratio_to_none = [a / b for a, b in zip(cost.decode_tokens_per_s, baseline)]
            cost.ratio_to_none_median = statistics.median(cost.ratio_to_none)
            cost.checks_per_call = checks_with_verdict(cost.checks, cost.level) / args.rounds
        return list(costs.values())

    async def _false_alarms(self, nc, mesh: BenchMesh, model_ref: str) -> FalseAlarms:
        args = self.args
        prompts = await asyncio.to_thread(prompt_texts, self.model.path, args.prompt_tokens, args.sessions)
        figures = FalseAlarms(replicas=args.alarm_replicas, sessions=args.sessions)
        _progress(f"false alarms: each of {args.sessions} prompts alone at verify=none, for its tokens ...")
        alone = [(await pipeline_generation(nc, model_ref, prompt, args.new_tokens, verify="none")).token_ids
                 for prompt in prompts]
        await self._warm_up(nc, mesh, model_ref, prompts[0], "all")
        checks_before, hosts_before = await self._checks(mesh), await scrape_hosts(mesh.metrics_urls)
        started = time.perf_counter()
        while figures.hop_steps_checked < args.target_checks and time.perf_counter() - started < args.budget_s:
            runs = await asyncio.gather(*(pipeline_generation(nc, model_ref, prompt, args.new_tokens, verify="all")
                                          for prompt in prompts))
            figures.waves += 1
            figures.calls += len(runs)
            figures.hop_steps_run += len(runs) * args.shards * args.new_tokens
            figures.answers_differing_from_alone += sum(run.token_ids != tokens for run, tokens in zip(runs, alone))
            figures.checks = checks_between(await self._checks(mesh), checks_before)
            # At `all` every check is one hop-step.
            figures.hop_steps_checked = checks_with_verdict(figures.checks, "all")
            _progress(f"  wave {figures.waves}: {figures.hop_steps_checked} hop-steps checked of "
                      f"{figures.hop_steps_run} run, {time.perf_counter() - started:.0f} s, checks {figures.checks}")
        figures.seconds = time.perf_counter() - started
        figures.false_alarms = figures.checks.get("mismatch", 0) + figures.checks.get("disputed", 0)
        hosts_after = await scrape_hosts(mesh.metrics_urls)
        figures.mean_decode_batch_rows = mean_batch_rows(hosts_after.batching, hosts_before.batching)
        return figures


def placement_args(args: argparse.Namespace) -> list[str]:
    """How the shards and the orchestrator hold and compute the layers (the honest error, and so the margin to the
    tolerance, depends on it: BENCHMARKS.md, "Honest shards: tolerances")."""
    return [*(["--dtype", args.dtype] if args.dtype else []), *(["--quantize", args.quantize] if args.quantize else [])]


def _load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def summary_text(summary: dict) -> str:
    """The summary as a reader wants it: one line per level, then the false alarms' verdict."""
    settings = summary["settings"]
    lines = [f"bench_verification {summary['started_at']}  ({summary['machine']['cpus']} CPUs, load average "
             f"{summary['machine']['load_average_before']} -> {summary['machine']['load_average_after']})",
             f"model {summary['model']['spec']} ({summary['model']['layers']} layers), {settings['shards']} shards, "
             f"prompt {settings['prompt_tokens']} tokens, {settings['new_tokens']} new tokens, sample rate "
             f"{settings['sample_rate']}, dtype {settings['dtype'] or 'checkpoint'}, weights "
             f"{settings['quantize'] or 'none'}"]
    if "cost" in summary:
        lines += ["", f"cost: one session, {summary['cost_replicas']} replicas per range, levels alternated per round",
                  f"  {'level':8s}{'decode tok/s (median)':>24s}{'x none (median)':>17s}{'checks/call':>13s}"
                  "  checks"]
        for cost in summary["cost"]:
            lines.append(f"  {cost['level']:8s}{cost['decode_tokens_per_s_median']:24.2f}"
                         f"{cost['ratio_to_none_median']:17.3f}{cost['checks_per_call']:13.1f}  "
                         + ", ".join(f"{k} {v}" for k, v in cost["checks"].items()))
    if "false_alarms" in summary:
        alarms = summary["false_alarms"]
        lines += ["", f"false alarms: verify=all, {alarms['replicas']} replicas per range, {alarms['sessions']} "
                  f"concurrent sessions, {alarms['waves']} waves ({alarms['calls']} calls) in "
                  f"{alarms['seconds']:.0f} s",
                  f"  hop-steps checked {alarms['hop_steps_checked']} (of {alarms['hop_steps_run']} run); checks "
                  + ", ".join(f"{k} {v}" for k, v in alarms["checks"].items()),
                  "  mean decode batch rows: " + ", ".join(f"{shard} {rows:.2f}" for shard, rows
                                                           in alarms["mean_decode_batch_rows"].items()),
                  f"  answers differing from the prompt alone at verify=none: {alarms['answers_differing_from_alone']}",
                  f"  [{'met' if alarms['false_alarms'] == 0 else 'MISSED'}] false alarms (mismatch + disputed) = 0: "
                  f"{alarms['false_alarms']}"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("cost", "false-alarms", "both"), default="both")
    parser.add_argument("--model", default="random:llama-250m")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the processes' logs here")
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--levels", default=",".join(LEVELS), help="comma-separated, `none` included")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--cost-replicas", type=int, default=None)
    parser.add_argument("--alarm-replicas", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--target-checks", type=int, default=10_000)
    parser.add_argument("--budget-s", type=float, default=600.0, help="the false-alarm waves stop after this")
    parser.add_argument("--sample-rate", type=float, default=None, help="[verification] sample_rate (default: its)")
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--dtype", default=None, help="the processes' --dtype (default: the checkpoint's)")
    parser.add_argument("--quantize", default=None, help="the processes' --quantize (default: none)")
    parser.add_argument("--cores-per-replica", type=int, default=None,
                        help="pin each replica's shard processes to cores of their own (as if on machines of their "
                             "own; needs replicas x this many cores)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.levels = [level.strip() for level in args.levels.split(",") if level.strip()]
    unknown = [level for level in args.levels if level not in LEVELS]
    if unknown or "none" not in args.levels:
        parser.error(f"--levels: expected some of {', '.join(LEVELS)}, `none` among them; got {args.levels}")
    for name in ("shards", "prompt_tokens", "rounds", "alarm_replicas", "sessions", "target_checks"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected at least 1")
    if args.new_tokens < 2:
        parser.error("--new-tokens: expected at least 2 (decode tokens/s needs two tokens)")
    if args.alarm_replicas < 2 and args.part != "cost":
        parser.error("--alarm-replicas: expected at least 2 (a check needs another replica)")
    if args.cost_replicas is None:
        args.cost_replicas = 1 + max(MIRRORS_PER_CHECK[level] for level in args.levels)
    if args.cores_per_replica is not None:
        replicas = max(args.cost_replicas if args.part != "false-alarms" else 1,
                       args.alarm_replicas if args.part != "cost" else 1)
        if not 1 <= args.cores_per_replica * replicas <= (os.cpu_count() or 1):
            parser.error(f"--cores-per-replica: {replicas} replicas x {args.cores_per_replica} cores do not fit "
                         f"this machine's {os.cpu_count()}")
    if args.sample_rate is not None and not 0 <= args.sample_rate <= 1:
        parser.error("--sample-rate: expected a value between 0 and 1")
    return args


def main() -> int:
    args = parse_args()
    try:
        summary = VerificationBench(args).run()
    except BenchError as error:
        print(f"bench_verification: {error}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2) if args.json else summary_text(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
