"""Where a shard's decode step spends its GPU time, by kernel: one session and a batch of eight over static KV
caches, graphed (wall time per step) and eager under torch.profiler (device time per step, top operators), and the
batched step's device time by attention width (the key positions every row attends).

    python3 scripts/gpu_profile_step.py --device cuda --json profile.json

Why (issue 14): `scripts/gpu_probe.py` found a graphed shard step taking far more GPU time than streaming its weights
would (BENCHMARKS.md, "On a GPU"); this script says which kernels take it. On the CPU it runs the tiny shape, to check
the script before device time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

static_cache_tokens = 4096  # the shards' default cuda_graph_max_tokens
prompt_tokens = 64
batch_sessions = 8
timed_steps = 20
profiled_steps = 3
widths_probed = (4096, 1024, 256)
# (shape, first layer, last layer): the first of three shards, as `hearth bench` splits each model.
gpu_shapes = (("tinyllama-1.1b", 0, 7), ("llama-250m", 0, 5))
cpu_shapes = (("tiny", 0, 2),)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (bf16) or cpu (fp32, the tiny shape)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    import torch

    cuda = args.device.startswith("cuda")
    figures = {shape: profile_shape(torch, shape, lo, hi, args.device, "bf16" if cuda else "fp32")
               for shape, lo, hi in (gpu_shapes if cuda else cpu_shapes)}
    print(json.dumps(figures, indent=1))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


def profile_shape(torch, shape: str, lo: int, hi: int, device: str, dtype: str) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoConfig

    from hearth.inference import load_layer_range
    from hearth.inference.batched import BatchRow
    from hearth.inference.host_staging import to_device, to_host
    from hearth.services.common.config_processes import ShardSettings
    from hearth.services.devtools.random_models import random_checkpoint

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    sort_key = "cuda_time_total" if cuda else "cpu_time_total"
    path = random_checkpoint("random:" + shape)
    hidden_size = AutoConfig.from_pretrained(path).hidden_size
    shard = ShardSettings()  # the KV limits a shard has by default
    runner = load_layer_range(path, lo, hi, device=device, dtype=dtype, static_cache_tokens=static_cache_tokens,
                              cache_budget_bytes=shard.kv_cache_budget_bytes, session_ttl_s=shard.eviction_idle_s)
    compute_dtype = next(parameter for _, parameter in runner.named_parameters()).dtype
    generator = torch.Generator().manual_seed(0)

    def states(tokens: int = 1):
        return to_device(torch.randn(1, tokens, hidden_size, generator=generator).to(compute_dtype), runner.device)

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    sessions = [f"s{index}" for index in range(batch_sessions)]
    for session in sessions:
        runner.forward(session, states(prompt_tokens), 0, "prefill")
    positions = dict.fromkeys(sessions, prompt_tokens)

    def solo_step() -> None:
        to_host(runner.forward(sessions[0], states(), positions[sessions[0]], "decode"))
        positions[sessions[0]] += 1

    def batch_step() -> None:
        for output in runner.step_batch([BatchRow(s, states(), positions[s]) for s in sessions]):
            to_host(output)
        for session in sessions:
            positions[session] += 1

    def wall_ms(step, steps: int) -> float:
        times = []
        for _ in range(steps):
            synchronize()
            started = time.perf_counter()
            step()
            synchronize()
            times.append((time.perf_counter() - started) * 1000.0)
        return round(statistics.median(times), 3)

    def profiled(step, title: str) -> float:
        """Device (CPU: host) microseconds per call of `step`, and its top operators printed."""
        step()
        synchronize()
        with profile(activities=activities) as profiler:
            for _ in range(profiled_steps):
                step()
            synchronize()
        print(f"==== {shape} layers {lo}-{hi}: {title}, {profiled_steps} steps", flush=True)
        print(profiler.key_averages().table(sort_by=sort_key, row_limit=12), flush=True)
        events = profiler.key_averages()
        # Self times of kernels and of the operators launching them both count as device time: the kernels' only.
        total_us = (sum(event.self_device_time_total for event in events if event.device_type.name == "CUDA")
                    if cuda else sum(event.self_cpu_time_total for event in events))
        return round(total_us / profiled_steps, 1)

    figures: dict[str, float] = {}
    for name, step in (("solo", solo_step), ("batch8", batch_step)):
        wall_ms(step, 4)  # captures, allocator
        figures[f"{name}_graphed_ms"] = wall_ms(step, timed_steps)
    figures["graph_captures"] = runner.graph_captures_total
    decoder = runner._static  # the step's own body, at widths of our choosing
    caches = [runner._caches._sessions[session].cache for session in sessions]
    hidden = torch.cat([states() for _ in sessions])
    position_ids = torch.tensor([positions[session] for session in sessions], device=runner.device).view(-1, 1)
    for width in (w for w in widths_probed if w <= decoder.max_tokens):
        for rows in (1, batch_sessions):
            def body(rows=rows, width=width):
                with torch.inference_mode():
                    decoder._body(caches[:rows], hidden[:rows], position_ids[:rows], width, lo, hi)
            figures[f"rows{rows}_width{width}_device_us"] = profiled(body, f"{rows} rows attending {width} positions")
    runner.close()
    print(shape, figures, flush=True)
    return figures


if __name__ == "__main__":
    main()
