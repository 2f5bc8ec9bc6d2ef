"""Measures what a long prompt's prefill does to other calls: a short request's time to first token idle and
while a `--long-tokens` prompt prefills, for each `--chunk-tokens` setting (0 = the whole prompt in one step) and
each `--slice-layers` setting of the shards (layers a long prefill step runs per compute-thread turn; 0 = whole)
and each `--prefill-nice` setting of the shards (nice levels of the thread those turns run on; 0 = compute thread).

Real processes on this machine (services.devtools.local_cluster.LocalCluster): nats-server, `--shards` shard hosts over even layer
ranges of a `random:<shape>` checkpoint (services.devtools.random_models; context 4 096) and, per chunk setting, a fresh
orchestrator started with `HEARTH_ORCHESTRATOR__PREFILL_CHUNK_TOKENS`. Per setting: `--short` short greedy
requests one after another on the idle mesh (idle TTFT), then the long request (one new token) and, once it has
been out `--short-delay-s`, the same short requests one after another while it runs; the long request's own TTFT
is reported too. Short requests that start after the long one has finished are not counted.

Usage: .venv/bin/python scripts/bench_interleave.py [--shape llama-250m] [--chunk-tokens 256 0]
       [--slice-layers 1 0] [--prefill-nice 10 0] [--long-tokens 4000] [--short-tokens 32] [--short 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hearth.services.devtools.bench.pipeline import pipeline_generation  # noqa: E402
from hearth.services.devtools.bench.prompts import build_prompt  # noqa: E402
from hearth.services.devtools.local_cluster import LocalCluster, even_layer_ranges  # noqa: E402
from hearth.services.broker.connection import connect_nats  # noqa: E402
from hearth.services.devtools.random_models import random_checkpoint  # noqa: E402

ready_timeout_s = 600.0
timeouts = dict(first_frame_timeout=600.0, frame_gap_timeout=600.0)


async def measure(cluster: LocalCluster, model: str, prompts: dict[str, str], args) -> dict[str, object]:
    nc = await connect_nats(cluster.nats_url, name="bench-interleave", settings=cluster.nats_settings())
    try:
        await pipeline_generation(nc, model, prompts["short"], 2, **timeouts)  # warm-up
        idle = [(await pipeline_generation(nc, model, prompts["short"], 2, **timeouts)).ttft_ms
                for _ in range(args.short)]
        long_started = time.perf_counter()
        long_call = asyncio.create_task(pipeline_generation(nc, model, prompts["long"], 1, **timeouts))
        await asyncio.sleep(args.short_delay_s)
        loaded = []
        for _ in range(args.short):
            if long_call.done():
                break
            loaded.append((await pipeline_generation(nc, model, prompts["short"], 2, **timeouts)).ttft_ms)
        long_timing = await long_call
        return dict(idle_ms=idle, loaded_ms=loaded, long_ttft_ms=long_timing.ttft_ms,
                    long_total_s=time.perf_counter() - long_started)
    finally:
        await nc.close()


def run_setting(path: Path, ranges, chunk_tokens: int, slice_layers: int, prefill_nice: int,
                prompts: dict[str, str], args) -> dict[str, object]:
    env = {"HEARTH_ORCHESTRATOR__PREFILL_CHUNK_TOKENS": str(chunk_tokens),
           "HEARTH_SHARD__PREFILL_SLICE_LAYERS": str(slice_layers), "HEARTH_SHARD__PREFILL_NICE": str(prefill_nice),
           "HEARTH_TRANSPORT__STEP_TIMEOUT_S": "120", "HEARTH_TRANSPORT__ACTIVATION_MACS": "false"}
    work_dir = (args.work_dir / f"chunk-{chunk_tokens}-slice-{slice_layers}-nice-{prefill_nice}"
                if args.work_dir else None)
    with LocalCluster(work_dir=work_dir, torch_threads=args.torch_threads, extra_env=env, log_level="INFO",
                      secure=False) as cluster:
        cluster.start_nats()
        for index, (lo, hi) in enumerate(ranges):
            cluster.start_shard(str(path), lo, hi, node_id=f"interleave-{index}", wait_ready=False)
        cluster.start_orchestrator(node_id="interleave-orchestrator", wait_ready=False,
                                   extra_args=["--preload", str(path), "--step-timeout-s", "120"])
        for process in cluster.processes:
            cluster.wait_ready(process, timeout_s=ready_timeout_s)
        return asyncio.run(measure(cluster, str(path), prompts, args))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-250m")
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--chunk-tokens", type=int, nargs="+", default=[256, 0])
    parser.add_argument("--slice-layers", type=int, nargs="+", default=[1],
                        help="[shard] prefill_slice_layers settings to compare (0: every step whole)")
    parser.add_argument("--prefill-nice", type=int, nargs="+", default=[10],
                        help="[shard] prefill_nice settings to compare (0: turns on the compute thread)")
    parser.add_argument("--long-tokens", type=int, default=4000)
    parser.add_argument("--short-tokens", type=int, default=32)
    parser.add_argument("--short", type=int, default=3, help="short requests per phase")
    parser.add_argument("--short-delay-s", type=float, default=2.0,
                        help="how long the long request is out before the first short one")
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the processes' logs here")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    path = random_checkpoint(f"random:{args.shape}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = {"short": build_prompt(tokenizer, path, args.short_tokens)[0],
               "long": build_prompt(tokenizer, path, args.long_tokens, variant=1)[0]}
    layers = int(json.loads((path / "config.json").read_text())["num_hidden_layers"])
    ranges = even_layer_ranges(layers, args.shards)
    command = ".venv/bin/python " + shlex.join(sys.argv)
    rows = []
    for chunk_tokens, slice_layers, nice in itertools.product(args.chunk_tokens, args.slice_layers,
                                                              args.prefill_nice):
        figures = run_setting(path, ranges, chunk_tokens, slice_layers, nice, prompts, args)
        idle, loaded = statistics.median(figures["idle_ms"]), figures["loaded_ms"]
        ratio = f"{statistics.median(loaded) / idle:.1f}x" if loaded else "n/a"
        loaded_text = ", ".join(f"{value:.0f}" for value in loaded) or "(long prompt done first)"
        row = (f"| {chunk_tokens or 'off (one step)'} | {slice_layers or 'off (whole)'} | {nice} | {idle:.0f} | "
               f"{loaded_text} | {ratio} | "
               f"{figures['long_ttft_ms'] / 1000:.1f} s |")
        print(row, flush=True)
        rows.append(row)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nMeasured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.machine()}, {os.cpu_count()} "
          f"CPUs (load average {load} at the end), random:{args.shape} on {args.shards} hops {ranges}; short prompt "
          f"{args.short_tokens} tokens, long prompt {args.long_tokens} tokens.\n\n```sh\n{command}\n```\n")
    print("| prefill_chunk_tokens | prefill_slice_layers | prefill_nice | short TTFT idle ms (median) | short TTFT "
          "while the long prompt prefills ms | ratio (median) | long prompt's TTFT |")
    print("|---|---|---|---:|---|---:|---:|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
