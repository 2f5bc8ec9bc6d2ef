"""Measures what the garbage collector costs a hearth process that imports torch, transformers and hearth's services:
the import with Python's default thresholds against full collections held back (hearth/services/common/process_gc.py),
the full collections that ran during it, and one full collection afterwards, over everything or with what exists
frozen. Each round runs in a fresh interpreter:

    .venv/bin/python scripts/bench_process_gc.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

# Run in a fresh interpreter: import the heavy modules, then time one full collection.
PROBE = """
import gc, json, sys, time
from hearth.services.common import process_gc
full = {"count": 0, "s": 0.0}
started = {}
def watch(phase, info):
    if info["generation"] != 2:
        return
    if phase == "start":
        started["at"] = time.perf_counter()
    else:
        full["count"] += 1
        full["s"] += time.perf_counter() - started["at"]
gc.callbacks.append(watch)
if sys.argv[1] == "held":
    process_gc.hold_full_collections()
began = time.perf_counter()
import torch, transformers.models.llama.modeling_llama
import hearth.services.shard.server, hearth.services.orchestrator.service
imported_s = time.perf_counter() - began
gc.callbacks.remove(watch)
during = dict(full)
if sys.argv[1] == "held":
    process_gc.freeze_startup_objects()
began = time.perf_counter()
gc.collect()
print(json.dumps({"import_s": imported_s, "full_collections": during["count"], "full_collections_s": during["s"],
                  "one_full_collection_ms": (time.perf_counter() - began) * 1000, "tracked": len(gc.get_objects()),
                  "frozen": gc.get_freeze_count()}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print("| round | mode | import s | full collections during it (s) | one full collection after, ms | tracked / frozen |")
    print("|---:|---|---:|---:|---:|---:|")
    for round_number in range(1, args.rounds + 1):
        for mode in ("default", "held"):
            output = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                                    timeout=300).stdout
            figures = json.loads(output.strip().splitlines()[-1])
            print(f"| {round_number} | {mode} | {figures['import_s']:.2f} | {figures['full_collections']} "
                  f"({figures['full_collections_s']:.2f}) | {figures['one_full_collection_ms']:.1f} | "
                  f"{figures['tracked']} / {figures['frozen']} |", flush=True)


if __name__ == "__main__":
    main()
