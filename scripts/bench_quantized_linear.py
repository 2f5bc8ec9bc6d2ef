"""Micro-benchmark of the CPU kernels a quantized Linear could run on: time per call and output error against fp32.

Candidates: fp32 nn.Linear; torch's dynamic int8 Linear (activations quantized per call too); hearth's int8 (fbgemm,
each activation row quantized on its own in two levels: hearth/inference/int8_kernels.py); torch's weight-only int8 op
`_weight_int8pack_mm` (per output channel, fp32 or bf16 activations); torch's weight-only int4 op
`_weight_int4pack_mm_for_cpu` (group-wise, fp32 or bf16 activations). Then, as decode reads them, one row through the
Linears of 16 layers of a 250M Llama shape in turn, so their weights come from memory rather than the cache, per
scheme (`layers_ms_per_token`). Prints one JSON object (BENCHMARKS.md, "Quantized shard kernels").
Usage: python scripts/bench_quantized_linear.py [--threads 1] [--repeats 200]
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hearth.inference.int8_kernels import fbgemm_row_product, int8_rows_on_cpu, pack_for_fbgemm  # noqa: E402
from hearth.inference.quantization import QuantizedLinear, parse_quantization  # noqa: E402
from hearth.inference.weight_codes import int4_grouped_codes  # noqa: E402

SHAPES = ((1024, 2816), (2816, 1024))
ROWS = (1, 8, 64)
INT4_GROUPS = (32, 64, 128)
# One layer's Linears of the 250M Llama shape (q, k, v, o; gate, up; down) as (in, out), and how many layers.
LAYER_LINEARS = ((1024, 1024),) * 4 + ((1024, 2816),) * 2 + ((2816, 1024),)
STREAMED_LAYERS = 16
STREAMED_SCHEMES = ("none", "int8", "int8-weight-only", "int4/g32")


def seconds_per_call(fn, repeats: int) -> float:
    for _ in range(max(3, repeats // 10)):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def int8_weight_only(weight: torch.Tensor):
    scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.clamp(torch.round(weight / scales[:, None]), -128, 127).to(torch.int8)
    return q, scales


def int4_weight_only(weight: torch.Tensor, group: int):
    codes, scales_and_zeros = int4_grouped_codes(weight, group)  # hearth's rounding, as its shards hold int4
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    return packed, scales_and_zeros


def error(ours: torch.Tensor, reference: torch.Tensor) -> dict:
    diff = (ours.float() - reference).abs()
    return {"max_abs": float(diff.max()), "rel": float(diff.norm() / reference.norm())}


def bench_shape(in_features: int, out_features: int, rows: int, repeats: int) -> dict:
    torch.manual_seed(0)
    dense = nn.Linear(in_features, out_features, bias=False).eval()
    x = torch.randn(rows, in_features)
    x_bf16 = x.to(torch.bfloat16)
    results: dict = {}
    with torch.inference_mode():
        reference = dense(x)
        results["fp32"] = {"us": seconds_per_call(lambda: dense(x), repeats) * 1e6}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dynamic = torch.ao.quantization.quantize_dynamic(nn.Sequential(dense), {nn.Linear}, dtype=torch.qint8)
        results["dynamic_int8"] = {"us": seconds_per_call(lambda: dynamic(x), repeats) * 1e6,
                                   **error(dynamic(x), reference),
                                   "warnings": sorted({str(w.message)[:120] for w in caught})}
        q8, scales8 = int8_weight_only(dense.weight)
        if int8_rows_on_cpu():
            packed8 = pack_for_fbgemm(q8, scales8)
            results["int8_rows_fbgemm"] = {"us": seconds_per_call(lambda: fbgemm_row_product(x, packed8), repeats) * 1e6,
                                           **error(fbgemm_row_product(x, packed8), reference)}
        for name, inputs, scales in (("int8pack_fp32", x, scales8), ("int8pack_bf16", x_bf16, scales8.bfloat16())):
            def call(inputs=inputs, scales=scales):
                return torch._weight_int8pack_mm(inputs, q8, scales)
            results[name] = {"us": seconds_per_call(call, repeats) * 1e6, **error(call(), reference)}
        for group in INT4_GROUPS:
            packed, scales_and_zeros = int4_weight_only(dense.weight, group)
            for dtype_name, inputs in (("fp32", x), ("bf16", x_bf16)):
                def call(packed=packed, sz=scales_and_zeros.to(inputs.dtype), group=group, inputs=inputs):
                    return torch._weight_int4pack_mm_for_cpu(inputs, packed, group, sz)
                results[f"int4pack_g{group}_{dtype_name}"] = {"us": seconds_per_call(call, repeats) * 1e6,
                                                              **error(call(), reference)}
    for entry in results.values():
        entry["us"] = round(entry["us"], 1)
    return results


def layers_ms_per_token(scheme: str, repeats: int) -> float:
    """Milliseconds for one row through every Linear of STREAMED_LAYERS layers under ``scheme``."""
    torch.manual_seed(0)
    linears = []
    for _ in range(STREAMED_LAYERS):
        for in_features, out_features in LAYER_LINEARS:
            dense = nn.Linear(in_features, out_features, bias=False)
            if scheme == "int8-weight-only":
                codes, scales = int8_weight_only(dense.weight.detach())
                scales = scales.bfloat16()
                linears.append(lambda x, codes=codes, scales=scales: torch._weight_int8pack_mm(
                    x.bfloat16(), codes, scales).float())
            else:
                linears.append(dense if scheme == "none" else QuantizedLinear(dense, parse_quantization(scheme)))
    rows = {features: torch.randn(1, features) for features in {shape[0] for shape in LAYER_LINEARS}}
    features_of = [in_features for _ in range(STREAMED_LAYERS) for in_features, _ in LAYER_LINEARS]
    with torch.inference_mode():
        return seconds_per_call(lambda: [linear(rows[features]) for linear, features
                                         in zip(linears, features_of)], max(3, repeats // 40)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {"torch": torch.__version__, "threads": args.threads, "cpu": torch.backends.cpu.get_cpu_capability(),
              "results": {}}
    for in_features, out_features in SHAPES:
        for rows in ROWS:
            key = f"{in_features}x{out_features}/rows{rows}"
            report["results"][key] = bench_shape(in_features, out_features, rows, args.repeats)
    report["layers_ms_per_token"] = {scheme: round(layers_ms_per_token(scheme, args.repeats), 1)
                                     for scheme in STREAMED_SCHEMES}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
