"""Whole-model greedy decode tokens/s of one process (`load_full`) per quantization scheme, with a 256-token
prefill's seconds, the layers' weight bytes and the greedy tokens' agreement with the first scheme; prints one JSON object (BENCHMARKS.md, "Quantized shard
kernels"). Usage: python scripts/bench_quantized_decode.py [--model random:llama-250m] [--schemes none,int8,int4/g64]
[--tokens 32] [--threads 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hearth.inference import SamplingParams, load_full  # noqa: E402
from hearth.services.common.config_processes import ShardSettings  # noqa: E402
from hearth.services.devtools.random_models import RANDOM_PREFIX, random_checkpoint  # noqa: E402

PROMPT_TOKENS = 16
PREFILL_TOKENS = 256


def decode_tokens_per_s(model, prompt_ids: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    """Decode tokens per wall-clock second and per second of this process's CPU time (steadier on a shared
    machine), and the tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    tokens = model.generate_ids(prompt_ids, params)
    first = [next(tokens)]  # the prefill's token: decode is timed from here
    start, start_cpu = time.perf_counter(), time.process_time()
    rest = list(tokens)
    return (len(rest) / (time.perf_counter() - start), len(rest) / (time.process_time() - start_cpu),
            first + rest)


def prefill_s(model, tokens: int) -> float:
    hidden = model.head.embed(list(range(10, 10 + tokens)))
    start = time.perf_counter()
    model.runner.forward("prefill-timing", hidden, 0, "prefill")
    elapsed = time.perf_counter() - start
    model.runner.reset("prefill-timing")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama-250m")
    parser.add_argument("--schemes", default="none,int8,int4/g32,int4/g64")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = random_checkpoint(args.model) if args.model.startswith(RANDOM_PREFIX) else Path(args.model)
    schemes = args.schemes.split(",")
    models = {}
    shard = ShardSettings()  # the KV limits a shard has by default
    for scheme in schemes:
        models[scheme] = load_full(path, quantization=scheme, cache_budget_bytes=shard.kv_cache_budget_bytes,
                                   session_ttl_s=shard.eviction_idle_s)
    prompt_ids = list(range(10, 10 + PROMPT_TOKENS))
    rates: dict[str, list[float]] = {scheme: [] for scheme in schemes}
    cpu_rates: dict[str, list[float]] = {scheme: [] for scheme in schemes}
    prefills: dict[str, list[float]] = {scheme: [] for scheme in schemes}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.rounds):  # alternating, so a busy neighbour slows every scheme alike
        for scheme in schemes:
            rate, cpu_rate, tokens[scheme] = decode_tokens_per_s(models[scheme], prompt_ids, args.tokens)
            rates[scheme].append(round(rate, 2))
            cpu_rates[scheme].append(round(cpu_rate, 2))
            prefills[scheme].append(round(prefill_s(models[scheme], PREFILL_TOKENS), 3))
    reference = tokens[schemes[0]]
    print(json.dumps({
        "model": args.model, "torch": torch.__version__, "threads": args.threads, "new_tokens": args.tokens,
        "schemes": {scheme: {
            "decode_tokens_per_s": rates[scheme],
            "decode_tokens_per_cpu_s": cpu_rates[scheme],
            f"prefill_{PREFILL_TOKENS}_s": prefills[scheme],
            "layer_weight_mb": round(models[scheme].runner.weight_bytes / 2**20, 1),
            "tokens_equal_to_first_scheme": sum(a == b for a, b in zip(tokens[scheme], reference)),
        } for scheme in schemes},
    }, indent=1))


if __name__ == "__main__":
    main()
