"""Measures how fast a shard answers the orchestrator's liveness probe (`stat` on its control subject) while it runs a
long prefill: the latency a stall check sees when it asks a busy shard whether it is still there.

Real processes on this machine (services.devtools.local_cluster.LocalCluster, open broker): nats-server and one
shard host over layers `--layers` of a `random:<shape>` checkpoint (services.devtools.random_models) or the bundled
model (`--model` takes any checkpoint folder). This script plays the orchestrator: it opens one hop on the shard,
sends one `--prefill-tokens` prefill step of random hidden states into it and, until the step's output comes back,
sends a `stat` probe every `--interval-ms` (and a keepalive, as an orchestrator does). Only the probes answered while
the prefill still ran are counted. `--rounds` prefills, each with a session of its own; the figures are over all.

Usage: .venv/bin/python scripts/bench_probe_latency.py [--shape llama-250m] [--model PATH] [--layers 0-3]
       [--prefill-tokens 2000] [--interval-ms 20] [--rounds 3] [--torch-threads N] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hearth.inference import weights_sha256  # noqa: E402
from hearth.protocol.control import CloseHop, ControlReply, OpenHop, StatShard  # noqa: E402
from hearth.protocol.subjects import LinkNodes, keepalive_subject, shard_control_subject  # noqa: E402
from hearth.services.broker.connection import connect_nats  # noqa: E402
from hearth.services.devtools.local_cluster import LocalCluster  # noqa: E402
from hearth.services.devtools.random_models import RANDOM_PREFIX, random_checkpoint  # noqa: E402
from hearth.services.transport import AckWindowSender, ActivationReceiver, FrameKind, StepInfo  # noqa: E402

node_id = "probed"
ready_timeout_s = 600.0
control_timeout_s = 10.0
# A probe slower than this counts as unanswered (an orchestrator would have given up long before).
probe_give_up_s = 5.0
prefill_timeout_s = 600.0


def percentile(ordered: list[float], share: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


async def probe_during_prefill(nc, control: str, model: Path, digest: str, layers: tuple[int, int], hidden_size: int,
                               round_index: int, args) -> tuple[list[float], int, float]:
    """One prefill with probes: the latencies (s) of the probes answered while it ran, the probes that went
    unanswered, and how long the prefill took."""
    import torch

    pipeline_id, session_id = f"p-probe-bench-{round_index}", f"s-probe-bench-{round_index}"
    open_hop = OpenHop(pipeline_id=pipeline_id, session_id=session_id, hop=0, hop_count=1, model_id=model.name,
                       weights_sha256=digest, layer_lo=layers[0], layer_hi=layers[1],
                       max_session_tokens=args.prefill_tokens)  # within the model's context, or refused
    reply = await nc.request(control, open_hop.model_dump_json().encode(), timeout=control_timeout_s)
    answer = ControlReply.model_validate_json(reply.data)
    if not answer.ok:
        raise RuntimeError(f"the shard refused the hop: {answer.code} {answer.message}")
    sink = ActivationReceiver(nc, pipeline_id, 1, nodes=LinkNodes(sender=node_id))
    sender = AckWindowSender(nc, pipeline_id, 0, nodes=LinkNodes(receiver=node_id))
    await sink.start()
    await sender.start()
    latencies, unanswered = [], 0
    try:
        hidden = torch.randn(1, args.prefill_tokens, hidden_size)
        started = time.perf_counter()
        await sender.send(StepInfo(session=session_id, step=1, kind=FrameKind.prefill, pos=0), hidden)
        output = asyncio.create_task(sink.next_step(timeout_s=prefill_timeout_s))
        while not output.done():
            await nc.publish(keepalive_subject(pipeline_id), b"")
            asked = time.perf_counter()
            try:
                await nc.request(control, StatShard().model_dump_json().encode(), timeout=probe_give_up_s)
            except TimeoutError:
                unanswered += 1
            else:
                if not output.done():  # answered while the prefill still ran
                    latencies.append(time.perf_counter() - asked)
            await asyncio.sleep(args.interval_ms / 1000.0)
        received = await output
        prefill_s = time.perf_counter() - started
        if tuple(received.tensor.shape) != (1, args.prefill_tokens, hidden_size):
            raise RuntimeError(f"unexpected output shape {tuple(received.tensor.shape)}")
    finally:
        await sender.close()
        await sink.close()
        await nc.publish(control, CloseHop(pipeline_id=pipeline_id).model_dump_json().encode())
    return latencies, unanswered, prefill_s


async def measure(cluster: LocalCluster, shard_id: str, model: Path, layers: tuple[int, int], args) -> dict:
    config = json.loads((model / "config.json").read_text())
    digest = await asyncio.to_thread(weights_sha256, model)
    control = shard_control_subject(node_id, shard_id)
    nc = await connect_nats(cluster.nats_url, name="bench-probe-latency", settings=cluster.nats_settings())
    latencies, unanswered, prefills = [], 0, []
    try:
        for round_index in range(args.rounds):
            answered, missed, prefill_s = await probe_during_prefill(
                nc, control, model, digest, layers, int(config["hidden_size"]), round_index, args)
            print(f"round {round_index + 1}: prefill {prefill_s:.2f} s, {len(answered)} probes answered during it, "
                  f"max {1000 * max(answered, default=0):.1f} ms, {missed} unanswered", flush=True)
            latencies += answered
            unanswered += missed
            prefills.append(prefill_s)
    finally:
        await nc.close()
    return dict(latencies=sorted(latencies), unanswered=unanswered, prefills=prefills)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-250m",
                        help="random:<shape> to serve (services.devtools.random_models)")
    parser.add_argument("--model", type=Path, default=None,
                        help="a checkpoint folder instead (the bundled model: --prefill-tokens within its context)")
    parser.add_argument("--layers", default="0-3", help="the shard's layer range LO-HI")
    parser.add_argument("--prefill-tokens", type=int, default=2000)
    parser.add_argument("--interval-ms", type=float, default=20.0, help="pause between one answer and the next probe")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the processes' logs here")
    args = parser.parse_args()
    model = args.model.resolve() if args.model else random_checkpoint(f"{RANDOM_PREFIX}{args.shape}")
    lo, hi = (int(part) for part in args.layers.split("-"))
    env = {"HEARTH_TRANSPORT__STEP_TIMEOUT_S": "600", "HEARTH_TRANSPORT__ACTIVATION_MACS": "false"}
    with LocalCluster(work_dir=args.work_dir, torch_threads=args.torch_threads, extra_env=env, secure=False,
                      metrics=False) as cluster:
        cluster.start_nats()
        shard = cluster.start_shard(str(model), lo, hi, node_id=node_id, wait_ready=False)
        cluster.wait_ready(shard, timeout_s=ready_timeout_s)
        figures = asyncio.run(measure(cluster, shard.ready_file.read_text().strip(), model, (lo, hi), args))
    latencies = figures["latencies"]
    if not latencies:
        print("no probe was answered while a prefill ran (prefills too short? more --prefill-tokens)")
        return 1
    p50, p95, worst = (1000 * percentile(latencies, share) for share in (0.50, 0.95, 1.0))
    load = " ".join(f"{value:.1f}" for value in os.getloadavg())
    prefills = ", ".join(f"{value:.1f}" for value in figures["prefills"])
    print(f"\nMeasured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.machine()}, {os.cpu_count()} CPUs "
          f"(load average {load} at the end); {model.name} layers {lo}-{hi}, {args.prefill_tokens}-token prefills "
          f"of {prefills} s; {len(latencies)} probes answered during them, {figures['unanswered']} unanswered.\n")
    print("| probes during a prefill | stat latency p50 / p95 / max | command |")
    print("|---|---|---|")
    print(f"| {len(latencies)} | {p50:.1f} / {p95:.1f} / {worst:.1f} ms | "
          f"`python {shlex.join(['scripts/bench_probe_latency.py', *sys.argv[1:]])}` |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
