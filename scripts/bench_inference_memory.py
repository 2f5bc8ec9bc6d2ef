"""Benchmark: resident memory of a quarter of a model's layers versus all of it, each in a fresh process.

Writes a random Llama checkpoint (default: hidden 1024, 16 layers, fp32) to a temporary folder, then starts
one subprocess per measurement so every figure starts from an empty heap, and prints every figure, then the rows of
BENCHMARKS.md's table "Inference memory" (markdown) for a human to paste.

    .venv/bin/python scripts/bench_inference_memory.py --machine "VM-B quiet"
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MEBIBYTE = 1 << 20
CHILD_TIMEOUT_S = 600
BENCH_PROMPT_TOKENS = 16
# What each fresh process loads; "baseline" only imports the libraries, so deltas isolate the weights.
MODES = ("baseline", "quarter_layers", "all_layers", "head", "full", "transformers_from_pretrained")


def read_proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def run_child(mode: str, path: Path, quarter_layers: int, dtype: str) -> dict:
    """Inside a fresh process: load what ``mode`` says, then report resident memory."""
    sys.path.insert(0, str(REPO_ROOT))
    import torch
    import transformers

    from hearth import inference
    from hearth.services.common.config_processes import ShardSettings

    shard = ShardSettings()  # the KV limits a shard has by default
    torch.set_num_threads(1)
    started = time.perf_counter()
    keep_alive = None
    weight_bytes = 0
    prompt_ids = list(range(1, 1 + BENCH_PROMPT_TOKENS))
    if mode in ("quarter_layers", "all_layers"):
        hi = (
            quarter_layers - 1
            if mode == "quarter_layers"
            else json.loads((path / "config.json").read_text())["num_hidden_layers"] - 1
        )
        keep_alive = inference.load_layer_range(path, 0, hi, dtype=dtype,
                                                cache_budget_bytes=shard.kv_cache_budget_bytes,
                                                session_ttl_s=shard.eviction_idle_s)
        weight_bytes = keep_alive.weight_bytes
        hidden_size = keep_alive.info.hidden_size

        def touch():
            keep_alive.forward("bench", torch.randn(1, BENCH_PROMPT_TOKENS, hidden_size), 0, "prefill")

    elif mode == "head":
        keep_alive = inference.load_head(path, dtype=dtype, load_tokenizer=False)
        weight_bytes = keep_alive.weight_bytes

        def touch():
            keep_alive.logits(keep_alive.embed(prompt_ids))

    elif mode == "full":
        keep_alive = inference.load_full(path, dtype=dtype, cache_budget_bytes=shard.kv_cache_budget_bytes,
                                         session_ttl_s=shard.eviction_idle_s)
        weight_bytes = keep_alive.runner.weight_bytes + keep_alive.head.weight_bytes

        def touch():
            hidden = keep_alive.runner.forward("bench", keep_alive.head.embed(prompt_ids), 0, "prefill")
            keep_alive.head.logits(hidden)

    elif mode == "transformers_from_pretrained":
        keep_alive = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        weight_bytes = sum(p.numel() * p.element_size() for p in keep_alive.parameters())

        def touch():
            with torch.inference_mode():
                keep_alive(torch.tensor([prompt_ids]), logits_to_keep=1)

    else:

        def touch():
            pass

    load_s = time.perf_counter() - started
    gc.collect()
    rss_after_load_kib = read_proc_status_kib("VmRSS")
    # Weights are memory-mapped from the safetensors files (as from_pretrained does): pages count as
    # resident once compute touches them, so the meaningful figure is after one forward pass.
    touch()
    gc.collect()
    return {
        "mode": mode,
        "rss_after_load_kib": rss_after_load_kib,
        "rss_kib": read_proc_status_kib("VmRSS"),
        "peak_rss_kib": read_proc_status_kib("VmHWM"),
        "weight_bytes": weight_bytes,
        "load_s": round(load_s, 2),
    }


def write_random_llama(
    folder: Path, hidden: int, layers: int, vocab: int, intermediate: int, shard_size: str
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        vocab_size=vocab,
        max_position_embeddings=2048,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, max_shard_size=shard_size)


def measure(mode: str, path: Path, args) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--path",
        str(path),
        "--quarter-layers",
        str(args.layers // 4),
        "--dtype",
        args.dtype,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def format_report(results: dict[str, dict], args, command_line: str) -> str:
    """Every figure of every process, then BENCHMARKS.md's rows (RSS over the baseline after a forward, weights)."""
    import torch

    baseline = results["baseline"]["rss_kib"]

    def mib(kib: float) -> str:
        return f"{kib / 1024:,.0f}".replace(",", " ")

    def over_baseline(mode: str) -> str:
        return mib(results[mode]["rss_kib"] - baseline)

    def weights(mode: str) -> str:
        return mib(results[mode]["weight_bytes"] / 1024)

    detail = []
    for mode in MODES:
        r = results[mode]
        cells = [mode, weights(mode), mib(r["rss_after_load_kib"] - baseline), mib(r["rss_kib"]),
                 over_baseline(mode), mib(r["peak_rss_kib"]), str(r["load_s"])]
        detail.append("| " + " | ".join(cells) + " |")
    quarter = results["quarter_layers"]["rss_kib"] - baseline
    all_layers = results["all_layers"]["rss_kib"] - baseline
    where = f"{args.machine}, {dt.datetime.now(dt.UTC):%Y-%m-%d}"
    command = f"`{command_line}`"
    load_times = [results[mode]["load_s"] for mode in MODES if mode != "baseline"]
    quarter_layers = args.layers // 4
    rows = [
        f"| {quarter_layers} of {args.layers} layers | {over_baseline('quarter_layers')} MiB "
        f"({weights('quarter_layers')}) | {command} | {where} |",
        f"| all {args.layers} layers | {over_baseline('all_layers')} MiB ({weights('all_layers')}) | same | {where} |",
        f"| the head (embedding, final norm, lm_head) | {over_baseline('head')} MiB ({weights('head')}) | same | "
        f"{where} |",
        f"| the whole model, `load_full` / transformers `from_pretrained` | {over_baseline('full')} / "
        f"{over_baseline('transformers_from_pretrained')} MiB ({weights('full')}) | same | {where} |",
        f"| load time, any of the above | {min(load_times):.2f}-{max(load_times):.2f} s | same | {where} |",
    ]
    lines = [
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}; "
        f"random Llama, hidden {args.hidden}, {args.layers} layers, intermediate {args.intermediate}, "
        f"vocab {args.vocab}, {args.dtype}, safetensors in {args.shard_size} files. Each row a fresh process "
        "(`VmRSS`/`VmHWM` from /proc/self/status); the baseline process only imports torch, transformers and "
        "inference.",
        "",
        "| what is loaded | weights MiB | RSS over baseline after load MiB "
        f"| RSS after a {BENCH_PROMPT_TOKENS}-token forward MiB | RSS over baseline after forward MiB "
        "| peak RSS MiB | load s |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *detail,
        "",
        f"A shard of {quarter_layers} of {args.layers} layers takes {quarter / all_layers:.2f}x the memory of all "
        "layers. Rows for BENCHMARKS.md, \"Inference memory\" (what is loaded | RSS after a "
        f"{BENCH_PROMPT_TOKENS}-token forward over the baseline (weights) | command | machine, date):",
        "",
        *rows,
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--shard-size", default="200MB")
    parser.add_argument("--machine", default="this machine",
                        help="the machine column of the rows printed (BENCHMARKS.md names its machines)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--quarter-layers", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        print(json.dumps(run_child(args.child, args.path, args.quarter_layers, args.dtype)))
        return

    measuring = [arg for arg in sys.argv[1:] if arg != args.machine and not arg.startswith("--machine")]
    command_line = shlex.join(["python", "scripts/bench_inference_memory.py", *measuring])
    with tempfile.TemporaryDirectory(prefix="hearth-bench-") as tmp:
        path = Path(tmp) / "random-llama"
        print(f"writing random checkpoint to {path} ...", file=sys.stderr)
        write_random_llama(path, args.hidden, args.layers, args.vocab, args.intermediate, args.shard_size)
        results = {}
        for mode in MODES:
            results[mode] = measure(mode, path, args)
            print(f"{mode}: {results[mode]}", file=sys.stderr)
    print(format_report(results, args, command_line))


if __name__ == "__main__":
    main()
