"""Where a GPU machine's decode time goes before any mesh is involved: kernel launch cost, transformers' generate()
with and without the bench's per-token streamer, hearth's one-process path (LocalModel: the shards' runner over every
layer, as `load_full` loads it, and the head), and one shard's decode step as a shard runs it (its layer range with
static caches and CUDA graphs, the input staged onto the device and the output copied to pinned host memory), split
into its parts, on the same model, device and dtype.

    python3 scripts/gpu_probe.py --model random:tinyllama-1.1b --device cuda --dtype bf16 --json probe.json

Written for issue 14's first GPU run, where `hearth bench`'s generate() baseline decoded TinyLlama-1.1B at 14 tok/s
on an H200 (the reference figure of ../shared/gpu/README.md is 69 tok/s on an H100), and the shards reported 2.0 ms
of compute per decode step of 7 layers (hearth_shard_step_compute_seconds), far above the GPU's time for them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

launches_per_probe = 2000
shard_step_probe_steps = 64
shard_static_cache_tokens = 4096  # the shards' default cuda_graph_max_tokens


def launch_cost_us(torch, device) -> float:
    """Microseconds per tiny kernel launch, queued back to back and synchronised once."""
    x = torch.zeros(16, device=device)
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(launches_per_probe):
        x.add_(1)
    torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / launches_per_probe * 1e6


def shard_step_ms(torch, path: Path, device: str, dtype: str, layers: tuple[int, int], hidden_size: int,
                  prompt_tokens: int) -> dict[str, float]:
    """Milliseconds per decode step of one layer range as a shard runs it, whole and by part (medians)."""
    from hearth.inference import load_layer_range
    from hearth.inference.host_staging import to_device, to_host
    from hearth.services.common.config_processes import ShardSettings

    shard = ShardSettings()  # the KV limits a shard has by default
    runner = load_layer_range(path, layers[0], layers[1], device=device, dtype=dtype,
                              cache_budget_bytes=shard.kv_cache_budget_bytes, session_ttl_s=shard.eviction_idle_s,
                              static_cache_tokens=shard_static_cache_tokens if device.startswith("cuda") else None)
    generator = torch.Generator().manual_seed(0)
    received = torch.randn(1, prompt_tokens, hidden_size, generator=generator).to(runner.info.dtype)
    runner.forward("probe", to_device(received, runner.device), 0, "prefill")
    parts: dict[str, list[float]] = {"to_device": [], "forward": [], "to_host": [], "whole": []}
    for index in range(shard_step_probe_steps):
        step_input = torch.randn(1, 1, hidden_size, generator=generator).to(runner.info.dtype)
        started = time.perf_counter()
        on_device = to_device(step_input, runner.device)
        staged = time.perf_counter()
        output = runner.forward("probe", on_device, prompt_tokens + index, "decode")
        forwarded = time.perf_counter()
        to_host(output)
        done = time.perf_counter()
        for key, seconds in (("to_device", staged - started), ("forward", forwarded - staged),
                             ("to_host", done - forwarded), ("whole", done - started)):
            parts[key].append(seconds * 1000.0)
    figures = {key: round(statistics.median(values[2:]), 3) for key, values in parts.items()}
    figures["graphs"] = runner.graphs_decode
    runner.close()
    return figures


def decode_rate(token_times_s: list[float]) -> float:
    """Tokens per second after the first token (the bench's decode figure)."""
    return (len(token_times_s) - 1) / (token_times_s[-1] - token_times_s[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:tinyllama-1.1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shard-layers", help="the layer range of the shard step to time, lo-hi (default: the first "
                        "of three shards, as `hearth bench` splits the model)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    import torch

    from hearth.services.devtools.bench.monolithic import MonolithicModel
    from hearth.services.devtools.bench.prompts import build_prompt
    from hearth.services.devtools.random_models import RANDOM_PREFIX, random_checkpoint

    path = random_checkpoint(args.model) if args.model.startswith(RANDOM_PREFIX) else Path(args.model)
    model = MonolithicModel(path, args.device, args.dtype)
    figures: dict[str, object] = {"model": args.model, "device": str(model.device), "dtype": model.info.dtype,
                                  "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    if model.device.type == "cuda":
        figures["gpu"] = torch.cuda.get_device_name(model.device)
        figures["launch_us"] = round(launch_cost_us(torch, model.device), 2)
    _, prompt_ids = build_prompt(model.tokenizer, path, args.prompt_tokens, 0)
    input_ids = torch.tensor([prompt_ids], device=model.device)

    def plain_generate() -> float:
        with torch.inference_mode():
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            started = time.perf_counter()
            model.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
        return args.new_tokens / (time.perf_counter() - started)

    runs: dict[str, list[float]] = {"generate_plain_tokens_per_s_incl_prefill": [],
                                    "generate_streamed_decode_tokens_per_s": [], "local_decode_tokens_per_s": []}
    plain_generate()  # warm-up: cuBLAS handles, allocator
    model.generate(prompt_ids, 4)
    model.generate_local(prompt_ids, 4)
    for repeat in range(args.repeats):
        runs["generate_plain_tokens_per_s_incl_prefill"].append(plain_generate())
        runs["generate_streamed_decode_tokens_per_s"].append(
            decode_rate(model.generate(prompt_ids, args.new_tokens).token_times_s))
        runs["local_decode_tokens_per_s"].append(
            decode_rate(model.generate_local(prompt_ids, args.new_tokens).token_times_s))
        print(f"round {repeat + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()),
              flush=True)
    figures["runs"] = runs
    if args.shard_layers:
        lo, hi = (int(bound) for bound in args.shard_layers.split("-"))
    else:
        from hearth.services.devtools.local_cluster import even_layer_ranges

        lo, hi = even_layer_ranges(model.model.config.num_hidden_layers, 3)[0]
    figures["shard_step_ms"] = shard_step_ms(torch, path, args.device, args.dtype, (lo, hi),
                                             model.model.config.hidden_size, args.prompt_tokens)
    print(f"shard step, layers {lo}-{hi}: {figures['shard_step_ms']}", flush=True)
    figures["medians"] = {key: round(statistics.median(values), 2) for key, values in runs.items()}
    print(json.dumps(figures, indent=1))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
