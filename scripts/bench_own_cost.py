"""What hearth's own code costs over the bare transport, measured in one run: the bare nats-py ring of
scripts/bench_ring_ceiling.py, then `hearth bench` (its 3-shard pipeline), then the ring again, on the same
`random:<shape>` checkpoint; the figure is hearth's pipeline decode tokens/s over the rings' mean.

Both rates are the mean rate over the decoded tokens ((tokens - 1) / decode time for hearth, as `hearth
bench` reports it; tokens / sum of step times for the ring), so a slow token counts the same on both sides.

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=20000 .venv/bin/python scripts/bench_own_cost.py --shape llama-250m
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench_ring_ceiling import run_mode

REPO_ROOT = Path(__file__).resolve().parents[1]


def ring_rates(path: str, ranges, threads: int, rounds: int, new_tokens: int) -> list[float]:
    """Mean decode tokens/s of each round of the bare nats ring, in a fresh process (bench_ring_ceiling's why)."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        generations = pool.submit(run_mode, "nats", path, ranges, threads, rounds, new_tokens).result()
    return [generation.mean_tokens_per_s for generation in generations]


def hearth_bench(shape: str, shards: int, repeats: int, new_tokens: int) -> dict:
    # `python -m hearth.services.cli` from this checkout (not the installed `hearth`): a worktree benches its own code.
    command = [sys.executable, "-m", "hearth.services.cli", "bench", "--model", f"random:{shape}", "--shards",
               str(shards), "--repeats", str(repeats), "--new-tokens", str(new_tokens), "--sessions", "1",
               "--no-library-defaults", "--json"]
    completed = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    return json.loads(completed.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-250m", help="a services.devtools.random_models shape")
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of every ring process")
    parser.add_argument("--rounds", type=int, default=3, help="ring rounds before and after, and bench repeats")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    from transformers import AutoConfig

    from hearth.services.devtools.local_cluster import even_layer_ranges
    from hearth.services.devtools.random_models import random_checkpoint

    path = str(random_checkpoint(f"random:{args.shape}"))
    ranges = even_layer_ranges(AutoConfig.from_pretrained(path).num_hidden_layers, args.shards)
    before = ring_rates(path, ranges, args.threads, args.rounds, args.new_tokens)
    print(f"bare nats ring, before: {' '.join(f'{r:.2f}' for r in before)} tok/s", flush=True)
    report = hearth_bench(args.shape, args.shards, args.rounds, args.new_tokens)
    pipeline = report["pipeline"]
    hearth_rates = [run["decode_tokens_per_s"] for run in pipeline["runs"]]
    print(f"hearth pipeline:        {' '.join(f'{r:.2f}' for r in hearth_rates)} tok/s", flush=True)
    after = ring_rates(path, ranges, args.threads, args.rounds, args.new_tokens)
    print(f"bare nats ring, after:  {' '.join(f'{r:.2f}' for r in after)} tok/s", flush=True)
    ring = statistics.mean(before + after)
    hearth = statistics.mean(hearth_rates)
    print(f"hearth / ring: {hearth:.2f} / {ring:.2f} = {hearth / ring:.3f}")
    print(f"generate() in the same run: {report['monolithic']['decode_tokens_per_s_median']:.2f} tok/s; "
          f"construction p50 / max {report['construct_ms_p50']} / {report['construct_ms_max']} ms")
    for figures in report["transport_decode"]:
        print(f"transport per hop, decode ({figures['shard_id']}): p50 {figures['p50_ms']} ms, "
              f"p95 {figures['p95_ms']} ms")


if __name__ == "__main__":
    main()
