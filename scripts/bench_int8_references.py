"""The int8 references hearth's CPU kernels are judged against, on this machine: torch's own dynamic int8 Linear over
a whole model's generate() (the issue's one-process reference), and torch.compile's weight-only int8 products.

`dynamic`: `random:llama-250m` (or --model) in transformers, fp32 and `torch.ao.quantization.quantize_dynamic` int8
(every Linear, lm_head included), greedy generate() decode tokens/s, alternated.
`compile`: one row through the Linears of 16 layers of the 250M Llama shape in turn (weights from memory, as decode
reads them): fp32, eager `torch._weight_int8pack_mm` (bf16 activations), and the weight-only product
`linear(x, codes.to(x.dtype)) * scales` under torch.compile, default and with freezing and max-autotune.
Prints one JSON object (BENCHMARKS.md, "Quantized shard kernels").
Usage: python scripts/bench_int8_references.py dynamic|compile [--threads 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_quantized_linear import LAYER_LINEARS, STREAMED_LAYERS, int8_weight_only  # noqa: E402
from hearth.services.devtools.random_models import RANDOM_PREFIX, random_checkpoint  # noqa: E402

PROMPT_TOKENS = 16
NEW_TOKENS = 32


def generate_decode_rate(model, prompt: torch.Tensor) -> float:
    """Greedy decode tokens/s of generate(): NEW_TOKENS tokens timed, less a one-token call (the prefill)."""
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        whole = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=1, do_sample=False)
        prefill = time.perf_counter() - start
    return (NEW_TOKENS - 1) / (whole - prefill)


def dynamic(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    path = random_checkpoint(args.model) if args.model.startswith(RANDOM_PREFIX) else Path(args.model)
    fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates its quantized tensors
        int8 = torch.ao.quantization.quantize_dynamic(
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), {nn.Linear}, dtype=torch.qint8)
    prompt = torch.tensor([list(range(10, 10 + PROMPT_TOKENS))])
    rates: dict[str, list[float]] = {"fp32": [], "torch_dynamic_int8": []}
    for model in (fp32, int8):  # warm-up
        generate_decode_rate(model, prompt)
    for _ in range(args.rounds):
        rates["fp32"].append(round(generate_decode_rate(fp32, prompt), 2))
        rates["torch_dynamic_int8"].append(round(generate_decode_rate(int8, prompt), 2))
    return {"model": args.model, "decode_tokens_per_s": rates}


class WeightOnlyInt8(nn.Module):
    """int8 codes per output row with bf16 scales; the product torch.compile is asked to fuse."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        codes, scales = int8_weight_only(torch.randn(out_features, in_features))
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales.to(torch.bfloat16))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(rows, self.codes.to(rows.dtype)) * self.scales


def streamed_ms(calls: list, rows: dict[int, torch.Tensor], rounds: int) -> float:
    """The best of ``rounds`` passes of one row through every (in_features, fn) in turn, in ms."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for in_features, fn in calls:
            fn(rows[in_features])
        best = min(best, time.perf_counter() - start)
    return round(best * 1e3, 1)


def compiled(args: argparse.Namespace) -> dict:
    import torch._inductor.config as inductor

    shapes = [shape for _ in range(STREAMED_LAYERS) for shape in LAYER_LINEARS]
    modules = [WeightOnlyInt8(in_features, out_features) for in_features, out_features in shapes]
    dense = [torch.randn(out_features, in_features) for in_features, out_features in shapes]
    rows = {features: torch.randn(1, features, dtype=torch.bfloat16) for features in (1024, 2816)}
    rows_fp32 = {features: row.float() for features, row in rows.items()}
    figures: dict[str, list[float]] = {}
    with torch.no_grad():
        eager = [(m.codes.shape[1], lambda x, m=m: torch._weight_int8pack_mm(x, m.codes, m.scales)) for m in modules]
        fp32 = [(w.shape[1], lambda x, w=w: nn.functional.linear(x, w)) for w in dense]
        start = time.perf_counter()
        default = [(m.codes.shape[1], torch.compile(m)) for m in modules]
        streamed_ms(default, rows, 1)
        compile_s = {"default": round(time.perf_counter() - start, 1)}
        torch._dynamo.reset()
        inductor.freezing, inductor.max_autotune = True, True
        start = time.perf_counter()
        autotuned = [(m.codes.shape[1], torch.compile(m)) for m in modules]
        streamed_ms(autotuned, rows, 1)
        compile_s["freezing_max_autotune"] = round(time.perf_counter() - start, 1)
        for _ in range(args.rounds):
            for name, calls, inputs in (("fp32", fp32, rows_fp32), ("eager_weight_int8pack_mm", eager, rows),
                                        ("compiled_default", default, rows),
                                        ("compiled_freezing_max_autotune", autotuned, rows)):
                figures.setdefault(name, []).append(streamed_ms(calls, inputs, 5))
    return {"layers": STREAMED_LAYERS, "layers_ms_per_token": figures, "compile_s": compile_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("dynamic", "compile"))
    parser.add_argument("--model", default="random:llama-250m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = dynamic(args) if args.what == "dynamic" else compiled(args)
    print(json.dumps({"torch": torch.__version__, "threads": args.threads, **result}, indent=1))


if __name__ == "__main__":
    main()
