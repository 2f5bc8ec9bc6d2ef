"""Benchmark: host memory a process gains while loading a layer range (or the orchestrator's head) from a checkpoint
(safetensors, or a GGUF file).

Issue 14 asks that weights load straight onto the device, the host's peak during the load staying within the
range's weight bytes + 10 %. Each case runs in a fresh subprocess that imports everything, resets the kernel's
resident high-water mark (writing "5" to /proc/self/clear_refs resets VmHWM), loads, and reports from
/proc/self/status: the peak resident memory added by the load (VmHWM − VmRSS before it), the resident memory
added once loaded, and after one 16-token forward pass (weights that need no dtype conversion stay memory-mapped
from the checkpoint on the CPU, so they become resident only when compute first touches them). "Imports
everything" includes the family's modeling module and a meta-device model (warm_up_imports): one-off costs of the
process, not of the weights. Each child gets an empty $HEARTH_CACHE_DIR unless --keep-cache is given, so an int4
load measures the rounding rather than the codes a host keeps on disk (hearth/inference/int4_code_cache.py), and a
GGUF's parsed metadata is parsed again.

    .venv/bin/python scripts/bench_load_memory.py                      # random:llama-250m, cpu, fp32 and bf16
    .venv/bin/python scripts/bench_load_memory.py --device cuda --dtypes bf16
    .venv/bin/python scripts/bench_load_memory.py --quantize int8 --cases head --dtypes fp32
"""

from __future__ import annotations

import argparse
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
FORWARD_TOKENS = 16
CASES = ("all_layers", "third_of_layers", "head")
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> str:
    """Reset VmHWM to the current RSS when the kernel allows it; says which peak the figures use."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return "VmHWM since process start (clear_refs not writable)"
    return "VmHWM reset before the load"


def what_to_load(case: str, path: Path) -> str:
    """"head", or the layer range "lo-hi" a case loads from the checkpoint at `path`."""
    if case == "head":
        return "head"
    num_layers = checkpoint_config(path).num_hidden_layers
    hi = num_layers - 1 if case == "all_layers" else max(1, num_layers // 3) - 1
    return f"0-{hi}"


def checkpoint_config(path: Path):
    """The transformers config of the checkpoint at `path` (a folder, a GGUF file or a folder holding one)."""
    sys.path.insert(0, str(REPO_ROOT))
    from hearth.inference.checkpoint import read_config, resolve_model_path

    return read_config(resolve_model_path(path))


def warm_up_imports(path: Path) -> None:
    """Pay the one-off costs a process meets on its first load of a family before the baseline: transformers imports
    the family's modeling module lazily (about 10 MiB here) and builds its first meta-device model (about 5 MiB)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = checkpoint_config(path)  # before the meta device: the modules it imports make tensors of their own
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(config)


def run_child(what: str, path: Path, dtype: str, device: str, quantization: str = "none") -> dict:
    """Inside a fresh process: load ``what`` ("head" or layers "lo-hi") under ``quantization`` and report its
    resident-memory figures."""
    sys.path.insert(0, str(REPO_ROOT))
    import torch

    from hearth import inference
    from hearth.inference.devices import synchronize
    from hearth.services.common.config_processes import ShardSettings

    shard = ShardSettings()  # the KV limits a shard has by default
    torch.set_num_threads(1)
    warm_up_imports(path)
    gc.collect()
    peak_method = reset_peak_rss()
    rss_before_kib = proc_status_kib("VmRSS")
    started = time.perf_counter()
    if what == "head":
        loaded = inference.load_head(path, dtype=dtype, device=device, load_tokenizer=False,
                                     quantization=quantization)

        def forward() -> None:
            loaded.logits(loaded.embed(list(range(1, 1 + FORWARD_TOKENS))))

    else:
        lo, hi = (int(bound) for bound in what.split("-"))
        loaded = inference.load_layer_range(path, lo, hi, dtype=dtype, device=device,
                                            cache_budget_bytes=shard.kv_cache_budget_bytes,
                                            session_ttl_s=shard.eviction_idle_s, quantization=quantization)

        def forward() -> None:
            hidden = torch.randn(1, FORWARD_TOKENS, loaded.info.hidden_size, dtype=loaded.info.dtype, device=device)
            loaded.forward("bench", hidden, 0, "prefill")

    synchronize(loaded.device)
    load_s = time.perf_counter() - started
    peak_kib = proc_status_kib("VmHWM")
    gc.collect()
    rss_loaded_kib = proc_status_kib("VmRSS")
    forward()
    synchronize(loaded.device)
    gc.collect()
    return {
        "layers": what,
        "dtype": dtype,
        "quantization": quantization,
        "device": str(loaded.device),
        "weight_bytes": loaded.weight_bytes,
        "peak_added_bytes": (peak_kib - rss_before_kib) * 1024,
        "loaded_added_bytes": (rss_loaded_kib - rss_before_kib) * 1024,
        "forward_added_bytes": (proc_status_kib("VmRSS") - rss_before_kib) * 1024,
        "baseline_rss_bytes": rss_before_kib * 1024,
        "load_s": round(load_s, 3),
        "peak_method": peak_method,
    }


def measure(case: str, path: Path, dtype: str, device: str, quantization: str, keep_cache: bool) -> dict:
    what = what_to_load(case, path)
    command = [sys.executable, __file__, "--child", what, "--path", str(path), "--dtype", dtype, "--device", device,
               "--quantize", quantization]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory(prefix="bench-load-cache-") as empty_cache:
        if not keep_cache:
            env["HEARTH_CACHE_DIR"] = empty_cache
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S)
    if result.returncode != 0:
        raise RuntimeError(f"{case} {dtype} failed:\n{result.stderr}")
    return {"case": case, **json.loads(result.stdout.strip().splitlines()[-1])}


def format_table(rows: list[dict]) -> str:
    def mib(num_bytes: int) -> str:
        return f"{num_bytes / MEBIBYTE:,.1f}"

    lines = [
        "| case | layers | dtype | quantization | device | weights MiB | peak RSS added by the load MiB | peak / weights "
        f"| RSS added, loaded MiB | RSS added after a {FORWARD_TOKENS}-token forward MiB | load s |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r["peak_added_bytes"] / r["weight_bytes"]
        lines.append(
            f"| {r['case']} | {r['layers']} | {r['dtype']} | {r['quantization']} | {r['device']} "
            f"| {mib(r['weight_bytes'])} "
            f"| {mib(r['peak_added_bytes'])} | {ratio:.3f} | {mib(r['loaded_added_bytes'])} "
            f"| {mib(r['forward_added_bytes'])} | {r['load_s']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:llama-250m", help="random:<shape>, a checkpoint folder or a GGUF file")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (figures are host memory)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    parser.add_argument("--quantize", default="none", help="the scheme to load in: none, int8, int4/g32, auto")
    parser.add_argument("--json", type=Path, help="also write the raw figures to this file")
    parser.add_argument("--keep-cache", action="store_true",
                        help="load with this host's $HEARTH_CACHE_DIR (int4 codes kept on disk, parsed GGUF metadata) "
                             "instead of an empty one")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # "head" or "lo-hi": what a measuring process loads
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        print(json.dumps(run_child(args.child, args.path, args.dtype, args.device, args.quantize)))
        return

    sys.path.insert(0, str(REPO_ROOT))
    from hearth.services.devtools.random_models import RANDOM_PREFIX, random_checkpoint

    path = random_checkpoint(args.model) if args.model.startswith(RANDOM_PREFIX) else Path(args.model)
    rows = []
    for dtype in args.dtypes.split(","):
        for case in args.cases.split(","):
            rows.append(measure(case, path, DTYPE_NAMES.get(dtype, dtype), args.device, args.quantize,
                                args.keep_cache))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    import torch

    print(f"{args.model} on {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"torch {torch.__version__}; peak: {rows[0]['peak_method']}; "
          f"{'this host' if args.keep_cache else 'an empty'} cache folder; baseline RSS "
          f"{rows[0]['baseline_rss_bytes'] / MEBIBYTE:,.0f} MiB")
    print()
    print("```sh")
    print(shlex.join([".venv/bin/python", "scripts/bench_load_memory.py", *sys.argv[1:]]))
    print("```")
    print()
    print(format_table(rows))


if __name__ == "__main__":
    main()
