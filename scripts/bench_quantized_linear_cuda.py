"""Micro-benchmark of hearth's quantized Linear on a CUDA GPU against a bf16 nn.Linear: time per call (kernels
replayed from a CUDA graph, so launch cost does not hide them) and output error, for Llama-3-8B's projection shapes.

Candidates: bf16 nn.Linear; QuantizedLinear int8 (activations quantized per row, torch._int_mm); torch's
_weight_int8pack_mm on the same codes; the codes widened to bf16 per call; QuantizedLinear int4 at group sizes
32/64/128 (tinygemm). Prints one JSON object (BENCHMARKS.md, "Quantized shards on a GPU").
Usage: python scripts/bench_quantized_linear_cuda.py [--repeats 200]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hearth.inference.quantization import QuantizedLinear, parse_quantization  # noqa: E402

SHAPES = ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096))
ROWS = (1, 8, 32)
SCHEMES = ("int8", "int4/g32", "int4/g64", "int4/g128")
CALLS_PER_GRAPH = 20


def microseconds_per_call(fn, repeats: int) -> float:
    """Mean time of one call, replaying a graph of CALLS_PER_GRAPH calls (eager timing if capture fails)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(CALLS_PER_GRAPH):
                fn()
        run, per_run = graph.replay, CALLS_PER_GRAPH
    except RuntimeError:
        run, per_run = fn, 1
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run()
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (repeats * per_run)


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours.float() - reference.float()).norm() / reference.float().norm())


def bench_shape(in_features: int, out_features: int, rows: int, repeats: int) -> dict:
    torch.manual_seed(0)
    dense = nn.Linear(in_features, out_features, bias=False, device="cuda", dtype=torch.float32).eval()
    nn.init.normal_(dense.weight, std=0.02)
    dense_bf16 = nn.Linear(in_features, out_features, bias=False, device="cuda", dtype=torch.bfloat16).eval()
    dense_bf16.weight.data.copy_(dense.weight.data)
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
    results: dict = {}
    with torch.inference_mode():
        reference = dense(x.float())
        results["bf16"] = {"us": microseconds_per_call(lambda: dense_bf16(x), repeats),
                           "rel_error": relative_error(dense_bf16(x), reference)}
        for label in SCHEMES:
            quantized = QuantizedLinear(dense, parse_quantization(label))
            results[label] = {"us": microseconds_per_call(lambda q=quantized: q(x), repeats),
                              "rel_error": relative_error(quantized(x), reference)}
            if label == "int8":
                codes, scales = quantized.weight_int8, quantized.scales

                def int8pack(codes=codes, scales=scales):
                    return torch._weight_int8pack_mm(x, codes, scales)

                def widened(codes=codes, scales=scales):
                    return torch.nn.functional.linear(x, codes.to(torch.bfloat16)) * scales

                for name, fn in (("int8pack_mm", int8pack), ("int8_widened", widened)):
                    try:
                        results[name] = {"us": microseconds_per_call(fn, repeats),
                                         "rel_error": relative_error(fn(), reference)}
                    except RuntimeError as exc:
                        results[name] = {"us": -1.0, "rel_error": -1.0, "error": str(exc)[:200]}
            del quantized
    for entry in results.values():
        entry["us"] = round(entry["us"], 2)
        entry["rel_error"] = round(entry["rel_error"], 5)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
              "results": {}}
    for in_features, out_features in SHAPES:
        for rows in ROWS:
            key = f"{in_features}x{out_features}/rows{rows}"
            try:
                report["results"][key] = bench_shape(in_features, out_features, rows, args.repeats)
            except Exception as exc:  # report a kernel a shape lacks, then go on with the others
                report["results"][key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(key, json.dumps(report["results"][key]), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
