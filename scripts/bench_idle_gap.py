"""Measures what a pause between decode steps costs the next step: back-to-back vs after an idle gap.

In a pipeline on one machine each shard process computes one step, then waits while the other hops
compute theirs; a monolithic generate() never waits. This times the same decode step of one layer range
(a shard's share of a `random:<shape>` checkpoint from services.devtools.random_models) in one process, back to back and
after sleeping between steps, with the OpenMP environment it was started with; each cell is the median / the mean
step (the mean carries the tail of slow steps, which a pipeline's tokens/s pays):

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/bench_idle_gap.py --shape llama-250m --layers 0-4 --threads 1 2
    (add --quantize int8 or int4/g32 for a quantized shard's layers)

`--between spin` fills the gap with a busy loop on the stepping thread instead of sleep (the core stays awake and
the caches keep the weights); `--between sweep` spends it streaming a 64 MiB buffer through the caches on every
thread (the caches lose the weights, the cores stay busy): which of those costs the next step tells an idle core's
wake-up from cold caches.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hearth.inference import load_head, load_layer_range
from hearth.services.common.config_processes import ShardSettings
from hearth.services.devtools.random_models import random_checkpoint

prompt_tokens = 64
sweep_bytes = 64 * 1024 * 1024
GAP_KINDS = ("sleep", "spin", "sweep")


def fill_gap(kind: str, gap_s: float, sweep: torch.Tensor) -> None:
    """Spend `gap_s` between two steps: asleep, spinning on this thread, or streaming `sweep` until it is over."""
    if kind == "sleep":
        time.sleep(gap_s)
        return
    until = time.perf_counter() + gap_s
    while time.perf_counter() < until:
        if kind == "sweep":
            sweep.add_(1.0)


def step_ms(runner, head, gap_s: float, steps: int, between: str, sweep: torch.Tensor) -> tuple[float, float]:
    """Median and mean decode-step time (ms) when each step follows `gap_s` seconds spent as `between` says."""
    runner.forward("gap", head.embed(list(range(5, 5 + prompt_tokens))), 0, "prefill")
    hidden = head.embed([7])
    times = []
    for index in range(steps):
        started = time.perf_counter()
        runner.forward("gap", hidden, prompt_tokens + index, "decode")
        times.append(time.perf_counter() - started)
        if gap_s:
            fill_gap(between, gap_s, sweep)
    runner.reset("gap")
    return statistics.median(times) * 1000.0, statistics.mean(times) * 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-250m")
    parser.add_argument("--layers", default="0-4", help="inclusive range, e.g. 0-4 (a third of 16 layers)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--gaps-ms", type=float, nargs="+", default=[0, 20, 60, 250])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quantize", default="none", help="none, int8 or int4/gN (the shard's scheme)")
    parser.add_argument("--between", choices=GAP_KINDS, default="sleep",
                        help="how a gap is spent: asleep, spinning on the stepping thread, or streaming 64 MiB")
    args = parser.parse_args()
    lo, hi = (int(part) for part in args.layers.split("-"))
    path = random_checkpoint(f"random:{args.shape}")
    shard = ShardSettings()  # the KV limits a shard has by default
    runner = load_layer_range(path, lo, hi, cache_budget_bytes=shard.kv_cache_budget_bytes,
                              session_ttl_s=shard.eviction_idle_s, quantization=args.quantize)
    head = load_head(path)
    sweep = torch.ones(sweep_bytes // 4)
    print(f"| threads | {' | '.join(f'gap {gap:g} ms' for gap in args.gaps_ms)} |")
    print(f"|---:|{'---:|' * len(args.gaps_ms)}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for _ in range(args.rounds):
            cells = ["{:.1f} / {:.1f} ms".format(*step_ms(runner, head, gap / 1000.0, args.steps, args.between,
                                                          sweep))
                     for gap in args.gaps_ms]
            print(f"| {threads} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
