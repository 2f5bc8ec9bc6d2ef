"""Where a shard's decode step spends its time: wall time against the time inside torch's operators, per scheme.

Loads one shard's layer range of a `random:<shape>` checkpoint (services.devtools.random_models) under each scheme,
prefills a context, then times decode steps back to back and runs more of them under torch.profiler. The wall time
less the operators' own time is Python and dispatch between operators; the table names the operators that take the
most:

    .venv/bin/python scripts/profile_decode_step.py --shape llama-250m --layers 0-4 --context 300 \\
        --schemes none int8 int4/g32 --threads 2

With ``--lean-vs-modules`` it times instead the one-token steps of the lean path (hearth/inference/lean_decode.py)
against transformers' modules on the same layers, alternated step by step over two sets of sessions fed the same
tokens (``--rows``: one session's solo step, or several sessions' batched step), and checks both give the same bits.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hearth.inference import load_head, load_layer_range
from hearth.inference.batched import run_batched_step
from hearth.inference.kv_growth import growing_cache
from hearth.services.common.config_processes import ShardSettings
from hearth.services.devtools.random_models import random_checkpoint

warmup_steps = 20
timed_steps = 40
profiled_steps = 20
operators_listed = 4


def profile_scheme(path, lo: int, hi: int, scheme: str, context: int) -> str:
    shard = ShardSettings()  # the KV limits a shard has by default
    runner = load_layer_range(path, lo, hi, cache_budget_bytes=shard.kv_cache_budget_bytes,
                              session_ttl_s=shard.eviction_idle_s, quantization=scheme)
    head = load_head(path)
    runner.forward("profile", head.embed([5 + index % 100 for index in range(context)]), 0, "prefill")
    hidden = head.embed([7])
    position = context

    def step() -> None:
        nonlocal position
        runner.forward("profile", hidden, position, "decode")
        position += 1

    for _ in range(warmup_steps):
        step()
    times = []
    for _ in range(timed_steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        for _ in range(profiled_steps):
            step()
    averages = sorted(profiled.key_averages(), key=lambda event: event.self_cpu_time_total, reverse=True)
    inside_ms = sum(event.self_cpu_time_total for event in averages) / 1000.0 / profiled_steps
    top = ", ".join(f"{event.key} {event.self_cpu_time_total / 1000.0 / profiled_steps:.2f} ms"
                    for event in averages[:operators_listed])
    runner.reset("profile")
    return (f"| {scheme} | {statistics.median(times) * 1000.0:.1f} | {inside_ms:.1f} | {top} |")


def compare_lean(path, lo: int, hi: int, scheme: str, context: int, steps: int, rows: int) -> str:
    """Median one-token step of ``rows`` sessions through layers lo..hi (one row: a solo step; more: a batched one),
    lean path against transformers' modules (alternated)."""
    shard = ShardSettings()
    runner = load_layer_range(path, lo, hi, cache_budget_bytes=shard.kv_cache_budget_bytes,
                              session_ttl_s=shard.eviction_idle_s, quantization=scheme)
    if not runner.lean_decode:
        return f"| {scheme} | {rows} | no lean path for this model | | |"
    head = load_head(path)
    lean_stack = runner._stack  # the runner's layers: passes run on them directly to pick the path per step
    stacks = {True: lean_stack, False: dataclasses.replace(lean_stack, lean=None)}
    prompts = [head.embed([5 + (index + row) % 100 for index in range(context + row)]) for row in range(rows)]
    caches = {}
    times: dict[bool, list[float]] = {True: [], False: []}
    with torch.inference_mode(), lean_stack.rotary_lock:
        for lean in (True, False):
            caches[lean] = [growing_cache(lean_stack.config) for _ in range(rows)]
            for cache, prompt in zip(caches[lean], prompts, strict=True):
                lean_stack.layer_pass(cache, prompt, 0, lo, hi).run()
        for step in range(warmup_steps + steps):
            hidden = [head.embed([7 + (step + row) % 50]) for row in range(rows)]
            positions = [context + row + step for row in range(rows)]
            outputs = {}
            for lean in (True, False):
                started = time.perf_counter()
                if rows == 1:
                    outputs[lean] = [stacks[lean].layer_pass(caches[lean][0], hidden[0], positions[0], lo, hi).run()]
                else:
                    outputs[lean] = run_batched_step(stack=stacks[lean], caches=caches[lean], hidden_states=hidden,
                                                     positions=positions, run_lo=lo, run_hi=hi)
                if step >= warmup_steps:
                    times[lean].append(time.perf_counter() - started)
            if not all(torch.equal(a, b) for a, b in zip(outputs[True], outputs[False], strict=True)):
                raise SystemExit(f"{scheme}: the lean step differs from the modules' at step {step}")
    lean_ms, modules_ms = (statistics.median(times[lean]) * 1000.0 for lean in (True, False))
    return f"| {scheme} | {rows} | {lean_ms:.2f} | {modules_ms:.2f} | {modules_ms / lean_ms:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-250m")
    parser.add_argument("--layers", default="0-4", help="inclusive range, e.g. 0-4 (a third of 16 layers)")
    parser.add_argument("--context", type=int, default=300, help="tokens prefilled before the decode steps")
    parser.add_argument("--schemes", nargs="+", default=["none", "int8", "int4/g32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lean-vs-modules", action="store_true",
                        help="time one-token steps on the lean path against transformers' modules instead")
    parser.add_argument("--steps", type=int, default=200, help="alternated steps each (with --lean-vs-modules)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1],
                        help="sessions stepping together (with --lean-vs-modules; more than one: a batched step)")
    args = parser.parse_args()
    lo, hi = (int(part) for part in args.layers.split("-"))
    torch.set_num_threads(args.threads)
    path = random_checkpoint(f"random:{args.shape}")
    if args.lean_vs_modules:
        print("| scheme | sessions | lean step (ms, median) | modules' step (ms, median) | modules ÷ lean |")
        print("|---|---:|---:|---:|---:|")
        for scheme in args.schemes:
            for rows in args.rows:
                print(compare_lean(path, lo, hi, scheme, args.context, args.steps, rows), flush=True)
        return
    print("| scheme | step, wall (ms, median) | inside operators (ms) | operators taking the most (a step) |")
    print("|---|---:|---:|---|")
    for scheme in args.schemes:
        print(profile_scheme(path, lo, hi, scheme, args.context), flush=True)


if __name__ == "__main__":
    main()
