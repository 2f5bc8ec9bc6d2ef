"""Measures the pause a client sees when a shard host dies (or freezes) mid-generation and the orchestrator
fails over.

Real processes on this machine (services.devtools.local_cluster.LocalCluster): nats-server, an orchestrator with
`--step-timeout-s`, replica shards r0-r2 (hop_weight 2) over three layer ranges of a random Llama (`--shape`,
hearth's `tiny` by default) or of `--model` (any checkpoint `hearth demo --model` takes: a folder, a GGUF file, a model
Ollama pulled; weights in `--quantize`'s scheme on every shard and the orchestrator's head), and for every
kill a fresh preferred shard (hop_weight 1) over one range (rotating first, middle, last hop).
Each round streams one greedy request and SIGKILLs the preferred shard (`--signal stop`: SIGSTOPs it, so its
connection stays open and only the step timeout and the liveness probe can tell) right after the client has
received `--kill-after-tokens` tokens. Every round must complete with exactly one `shard_failover` and the same tokens
as an uninterrupted run, or the bench fails.

Reported per round and as p50/p95 (client-side instants, monotonic clock):
- pause: the gap between the two token_delta frames around the failover (what a reader of the stream sees);
- kill -> resume: from the SIGKILL to the first token after it;
- detection: kill -> `shard_status: degraded`; repair: degraded -> `shard_failover` (repick, open hops);
  re-prefill: `shard_failover` -> next token (prompt + generated tokens through the new chain, one sample).

Usage: .venv/bin/python scripts/bench_failover.py [--kills 12] [--signal kill|stop] [--step-timeout-s 1.0]
       [--shape tiny | --model PATH] [--quantize none|int8|int4|auto] [--markdown]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import signal
import sqlite3
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hearth.services.devtools.local_cluster import LocalCluster, even_layer_ranges  # noqa: E402
from hearth.services.client.chat import stream_chat  # noqa: E402
from hearth.protocol.chat import ChatParams, ChatRequest  # noqa: E402
from hearth.protocol.chat_frames import TokenDeltaFrame  # noqa: E402
from hearth.services.broker.connection import connect_nats  # noqa: E402
from hearth.services.devtools.demo_model import DemoModel, resolve_demo_model  # noqa: E402
from hearth.services.devtools.random_models import RANDOM_PREFIX, RANDOM_SHAPES  # noqa: E402

PROMPT = "the quick brown fox jumps over"
health_timeout_s = 5.0
heartbeat_s = 0.5
routable_timeout_s = 30.0


@dataclass
class Round:
    hop: int
    pause_s: float
    kill_to_resume_s: float
    detection_s: float
    repair_s: float
    reprefill_s: float


def layer_ranges(model: DemoModel) -> list[tuple[int, int]]:
    return even_layer_ranges(model.num_layers, 3)


def describe(model: DemoModel, args) -> str:
    """The model as the report names it."""
    if args.model is None:
        dims = RANDOM_SHAPES[args.shape]
        return f"random Llama `{args.shape}` ({dims['num_hidden_layers']} layers, hidden {dims['hidden_size']})"
    return f"`{model.path.name}` ({model.num_layers} layers)"


def percentile(values: list[float], q: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


async def wait_routable(db_path: Path, shard_id: str) -> None:
    """Until the orchestrator's routing read model holds the shard's advertisement."""
    deadline = time.monotonic() + routable_timeout_s
    while time.monotonic() < deadline:
        if db_path.exists():
            with contextlib.closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)) as db:
                with contextlib.suppress(sqlite3.OperationalError):
                    row = db.execute("SELECT status FROM shards WHERE shard_id = ?", (shard_id,)).fetchone()
                    if row and row[0] == "advertised":
                        return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{shard_id} never became routable")


async def stream(nc, request: ChatRequest, kill=None, after_tokens: int = 0):
    frames, times, killed_at, tokens = [], [], None, 0
    async for frame in stream_chat(nc, request, first_frame_timeout=60.0, frame_gap_timeout=30.0):
        frames.append(frame)
        times.append(time.monotonic())
        if isinstance(frame, TokenDeltaFrame):
            tokens += 1
            if kill is not None and tokens == after_tokens:
                killed_at = time.monotonic()
                kill()
    return frames, times, killed_at


def measure(hop: int, frames, times, killed_at) -> Round:
    index = {frame.type: i for i, frame in enumerate(frames) if frame.type in ("shard_status", "shard_failover")}
    status_i, failover_i = index["shard_status"], index["shard_failover"]
    before = max(i for i, f in enumerate(frames[:status_i]) if isinstance(f, TokenDeltaFrame))
    after = min(i for i, f in enumerate(frames) if i > failover_i and isinstance(f, TokenDeltaFrame))
    return Round(hop=hop, pause_s=times[after] - times[before], kill_to_resume_s=times[after] - killed_at,
                 detection_s=times[status_i] - killed_at, repair_s=times[failover_i] - times[status_i],
                 reprefill_s=times[after] - times[failover_i])


async def run_rounds(cluster: LocalCluster, model: DemoModel, db_path: Path, args) -> list[Round]:
    nc = await connect_nats(cluster.nats_url, name="bench-failover", settings=cluster.nats_settings())
    request = ChatRequest(model=model.argument, prompt=PROMPT, max_tokens=args.max_tokens, temperature=0.0,
                          params=ChatParams(fallback_to_local=False))
    rounds: list[Round] = []
    try:
        frames, _, _ = await stream(nc, request)
        reference = [f.token_id for f in frames if isinstance(f, TokenDeltaFrame)]
        if frames[-1].type != "done" or len(reference) <= args.kill_after_tokens:
            raise RuntimeError(f"reference run too short: {frames[-1]}")
        for number in range(args.kills):
            ranges = layer_ranges(model)
            hop = number % len(ranges)
            lo, hi = ranges[hop]
            victim = await asyncio.to_thread(
                cluster.start_shard, model.argument, lo, hi, node_id=f"victim{number}",
                extra_args=["--hop-weight", "1.0", "--heartbeat-s", str(heartbeat_s), "--quantize", args.quantize])
            shard_id = victim.ready_file.read_text().strip()
            await wait_routable(db_path, shard_id)
            signum = signal.SIGKILL if args.signal == "kill" else signal.SIGSTOP
            frames, times, killed_at = await stream(nc, request, lambda: victim.signal(signum),
                                                    args.kill_after_tokens)
            tokens = [f.token_id for f in frames if isinstance(f, TokenDeltaFrame)]
            failovers = [f for f in frames if f.type == "shard_failover"]
            if frames[-1].type != "done" or len(failovers) != 1 or tokens != reference:
                raise RuntimeError(f"round {number}: final {frames[-1].type}, {len(failovers)} failovers, "
                                   f"tokens equal: {tokens == reference}")
            if failovers[0].failed_shard_id != shard_id:
                raise RuntimeError(f"round {number}: failed over from {failovers[0].failed_shard_id}, not {shard_id}")
            result = measure(hop, frames, times, killed_at)
            rounds.append(result)
            print(f"round {number:2d} hop {hop}: pause {result.pause_s * 1000:7.0f} ms  signal->resume "
                  f"{result.kill_to_resume_s * 1000:7.0f} ms  (detect {result.detection_s * 1000:.0f}, repair "
                  f"{result.repair_s * 1000:.0f}, re-prefill {result.reprefill_s * 1000:.0f})", flush=True)
            await asyncio.to_thread(victim.stop)  # SIGCONT first when frozen
    finally:
        await nc.close()
    return rounds


def report(rounds: list[Round], model: DemoModel, args, command: str) -> str:
    def row(name: str, values: list[float]) -> str:
        return (f"| {name} | {percentile(values, 50) * 1000:.0f} | {percentile(values, 95) * 1000:.0f} | "
                f"{max(values) * 1000:.0f} |")

    what = "dies (SIGKILL)" if args.signal == "kill" else "freezes (SIGSTOP)"
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        f"## Failover: the pause a client sees when a shard host {what} mid-generation",
        "",
        f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.machine()}, "
        f"{os.cpu_count()} CPUs (load average {load} at the end, shared with other work), "
        f"Python {platform.python_version()}. {len(rounds)} SIG{args.signal.upper()}s of the preferred shard "
        f"(first, middle and last hop in turn) after {args.kill_after_tokens} streamed tokens of a {args.max_tokens}-token greedy "
        f"request; {describe(model, args)}, "
        f"weights {args.quantize}, on 3 hops, one replica per hop; step timeout "
        f"{args.step_timeout_s} s. Every round completed with exactly one `shard_failover` and the tokens of an "
        "uninterrupted run. Client-side instants.",
        "",
        "```sh",
        command,
        "```",
        "",
        "| figure | p50 ms | p95 ms | max ms |",
        "|---|---:|---:|---:|",
        row("pause (token before -> token after the failover)", [r.pause_s for r in rounds]),
        row("signal -> first token after it", [r.kill_to_resume_s for r in rounds]),
        row("detection (signal -> shard_status degraded)", [r.detection_s for r in rounds]),
        row("repair (degraded -> shard_failover: repick, open)", [r.repair_s for r in rounds]),
        row("re-prefill (shard_failover -> next token)", [r.reprefill_s for r in rounds]),
        "",
    ]
    target = percentile([r.pause_s for r in rounds], 95) <= 2.0
    lines.append(f"Target: pause <= 2 s with a {args.step_timeout_s} s step timeout: "
                 f"{'met' if target else 'NOT met'} at p95.")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=12)
    parser.add_argument("--step-timeout-s", type=float, default=1.0)
    parser.add_argument("--kill-after-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--signal", choices=("kill", "stop"), default="kill",
                        help="SIGKILL the shard host (it dies) or SIGSTOP it (frozen, connection open)")
    parser.add_argument("--shape", default="tiny", choices=sorted(RANDOM_SHAPES), help="random model shape")
    parser.add_argument("--model", help="any checkpoint `hearth demo --model` takes instead of a random shape (a "
                                        "folder, a GGUF file, ollama:NAME[:TAG])")
    parser.add_argument("--quantize", default="none",
                        help="every shard's and the head's scheme: none, int8, int4[/gN], auto (a GGUF's own)")
    parser.add_argument("--markdown", action="store_true", help="print the BENCHMARKS.md section at the end")
    args = parser.parse_args()
    if args.kills < 1:
        parser.error("--kills must be at least 1")
    command = ".venv/bin/python scripts/bench_failover.py " + " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="hearth-bench-failover-") as tmp:
        work = Path(tmp)
        model = resolve_demo_model(args.model or f"{RANDOM_PREFIX}{args.shape}")
        env = {"HEARTH_RESEARCH__DISTRIBUTED_INFERENCE__SHARD_HEALTH_TIMEOUT_S": str(health_timeout_s)}
        db_path = work / "routing.sqlite"
        with LocalCluster(work_dir=work / "cluster", torch_threads=1, extra_env=env) as cluster:
            cluster.start_nats()
            for hop, (lo, hi) in enumerate(layer_ranges(model)):
                cluster.start_shard(model.argument, lo, hi, node_id=f"r{hop}", wait_ready=False,
                                    extra_args=["--hop-weight", "2.0", "--heartbeat-s", str(heartbeat_s),
                                                "--quantize", args.quantize])
            cluster.start_orchestrator(extra_args=[
                "--preload", model.argument, "--db", str(db_path),
                "--step-timeout-s", str(args.step_timeout_s), "--quantize", args.quantize], wait_ready=False)
            cluster.wait_all_ready()
            try:
                rounds = asyncio.run(run_rounds(cluster, model, db_path, args))
            except Exception:
                for process in cluster.processes:
                    print(f"----- {process.name} -----\n{process.log_tail(3000)}", file=sys.stderr)
                raise
    text = report(rounds, model, args, command)
    print()
    print(text if args.markdown else text.split("```\n", 2)[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
