"""Micro-benchmark of a decode step's KV-cache append: transformers' DynamicLayer (joins old and new into a fresh
tensor) against hearth's GrowingLayer (writes into room it keeps, hearth/inference/kv_growth.py), then the same
append followed by the step's attention (SDPA, one query row), for a shard of 6 layers of the 250M Llama shape
(16 heads of 64, float32) at a few context lengths. Prints one JSON object (BENCHMARKS.md, "KV caches that grow in
place").
Usage: python scripts/bench_kv_growth.py [--threads 1] [--steps 64] [--contexts 64,400,2000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hearth.inference.kv_growth import GrowingLayer  # noqa: E402

HEADS, HEAD_DIM, LAYERS = 16, 64, 6


def step_ms(layer_class, context: int, steps: int, attend: bool) -> float:
    """Mean ms of one decode step over LAYERS layers holding `context` positions (the append, and the attention)."""
    layers = [layer_class() for _ in range(LAYERS)]
    for layer in layers:
        layer.update(torch.randn(1, HEADS, context, HEAD_DIM), torch.randn(1, HEADS, context, HEAD_DIM))
    new = [(torch.randn(1, HEADS, 1, HEAD_DIM), torch.randn(1, HEADS, 1, HEAD_DIM)) for _ in range(steps)]
    query = torch.randn(1, HEADS, 1, HEAD_DIM)
    started = time.perf_counter()
    for keys_values in new:
        for layer in layers:
            keys, values = layer.update(*keys_values)
            if attend:
                F.scaled_dot_product_attention(query, keys, values)
    return 1000.0 * (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--contexts", default="64,400,2000")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for context in (int(value) for value in args.contexts.split(",")):
        row = {"context": context}
        for name, layer_class in (("dynamic", DynamicLayer), ("growing", GrowingLayer)):
            row[f"{name}_append_ms"] = round(step_ms(layer_class, context, args.steps, attend=False), 3)
            row[f"{name}_append_attend_ms"] = round(step_ms(layer_class, context, args.steps, attend=True), 3)
        rows.append(row)
    print(json.dumps({"threads": args.threads, "layers": LAYERS, "steps": args.steps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
