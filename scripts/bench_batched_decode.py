"""Benchmark: decode tokens/s of one layer range stepping B sessions one by one versus as one batched step
(LayerRangeRunner.forward vs step_batch), for B = 1, 2, 4, 8: the compute ceiling of continuous batching on a
shard, without transport or other processes.

    .venv/bin/python scripts/bench_batched_decode.py --model random:llama-250m --layers 0-5 [--device cuda]
        [--cpu-linear-kernel torch|onednn-batched|onednn] [--prompt-tokens 1000] [--quantize int8]

Prints a table (tokens/s one by one, batched, speed-up; the best of --repeats alternating runs) and, with --json,
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

# This checkout's packages, not whichever checkout the virtualenv's editable install points at.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hearth.inference import load_head, load_layer_range  # noqa: E402
from hearth.inference.batched import BatchRow  # noqa: E402
from hearth.inference.cpu_kernels import CPU_LINEAR_KERNELS, DEFAULT_CPU_LINEAR_KERNEL  # noqa: E402
from hearth.services.common.config_processes import ShardSettings  # noqa: E402
from hearth.services.devtools.random_models import random_checkpoint  # noqa: E402


def measure(runner, head, sessions: int, steps: int, prompt_tokens: int, batched: bool, device) -> float:
    ids = [f"b{sessions}-{int(batched)}-{i}" for i in range(sessions)]
    for index, sid in enumerate(ids):  # different prompt lengths, as real sessions have
        runner.forward(sid, head.embed(list(range(3, 3 + prompt_tokens + index))), 0, "prefill")
    positions = {sid: prompt_tokens + index for index, sid in enumerate(ids)}
    token = head.embed([42])

    def step() -> None:
        if batched:
            runner.step_batch([BatchRow(sid, token, positions[sid]) for sid in ids])
        else:
            for sid in ids:
                runner.forward(sid, token, positions[sid], "decode")
        for sid in ids:
            positions[sid] += 1

    step()  # warm-up (graph capture, allocator)
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    for sid in ids:
        runner.reset(sid)
    return sessions * steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama-250m")
    parser.add_argument("--layers", default="0-5", help="inclusive layer range, e.g. 0-5 (a third of llama-250m)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each; the best counts (a shared "
                        "machine's neighbours only ever slow a run down)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--cpu-linear-kernel", choices=CPU_LINEAR_KERNELS, default=DEFAULT_CPU_LINEAR_KERNEL,
                        help="which kernel the layers' projections run on (hearth/inference/cpu_kernels.py)")
    parser.add_argument("--quantize", default="none", help="the layers' scheme: none, int8, int4[/gN]")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = random_checkpoint(args.model.removeprefix("random:")) if args.model.startswith("random:") else args.model
    lo, hi = (int(part) for part in args.layers.split("-"))
    device = torch.device(args.device)
    head = load_head(path, device=args.device)
    shard = ShardSettings()  # the KV limits a shard has by default
    runner = load_layer_range(path, lo, hi, device=args.device, cpu_linear_kernel=args.cpu_linear_kernel,
                              quantization=args.quantize,
                              cache_budget_bytes=shard.kv_cache_budget_bytes, session_ttl_s=shard.eviction_idle_s)
    rows = []
    for sessions in (1, 2, 4, 8):
        one_by_one = batched = 0.0
        for _ in range(args.repeats):
            one_by_one = max(one_by_one, measure(runner, head, sessions, args.steps, args.prompt_tokens, False, device))
            batched = max(batched, measure(runner, head, sessions, args.steps, args.prompt_tokens, True, device))
        rows.append({"sessions": sessions, "one_by_one_tokens_per_s": round(one_by_one, 2),
                     "batched_tokens_per_s": round(batched, 2), "speedup": round(batched / one_by_one, 2)})
    if args.json:
        print(json.dumps({"model": args.model, "layers": args.layers, "device": args.device,
                          "cpu_linear_kernel": args.cpu_linear_kernel, "quantization": args.quantize,
                          "prompt_tokens": args.prompt_tokens,
                          "threads": torch.get_num_threads(), "rows": rows}))
        return
    print(f"{args.model} layers {args.layers} on {args.device} ({torch.get_num_threads()} threads, "
          f"{args.cpu_linear_kernel} linear kernel, {args.quantize} weights, {args.prompt_tokens}-token prompts)")
    print("sessions  one-by-one tok/s  batched tok/s  speed-up")
    for row in rows:
        print(f"{row['sessions']:8d}  {row['one_by_one_tokens_per_s']:16.2f}  {row['batched_tokens_per_s']:13.2f}  "
              f"{row['speedup']:8.2f}")


if __name__ == "__main__":
    main()
