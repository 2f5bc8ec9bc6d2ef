"""Benchmark: the orchestrator's head steps (final norm + lm_head, greedy pick, next embedding) of B sessions one by one
versus as one batch (hearth/inference/head_batch.py), for B = 1, 2, 4, 8: what the head batcher saves per token, without
transport or other processes.

    .venv/bin/python scripts/bench_batched_head.py --model random:llama-250m --threads 1
    .venv/bin/python scripts/bench_batched_head.py --model SmolLM2-135M-Instruct.Q4_1.gguf --quantize int4

`--quantize` loads the head as a quantized mesh's orchestrator holds it (hearth/inference/head_weights.py).

Prints a table (head steps/s one by one, batched, speed-up; the best of --repeats alternating runs) and the share of
256 random rows that a batch would recompute alone as near ties.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

# This checkout's packages, not whichever checkout the virtualenv's editable install points at.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hearth.inference import load_head  # noqa: E402
from hearth.inference.head_batch import HeadRow, batched_next_tokens, solo_next_token  # noqa: E402
from hearth.inference.sampling import SamplingParams  # noqa: E402
from hearth.services.devtools.random_models import random_checkpoint  # noqa: E402

GREEDY = SamplingParams()


def steps_per_second(head, rows: list[HeadRow], rounds: int, batched: bool) -> float:
    started = time.perf_counter()
    for _ in range(rounds):
        tokens = batched_next_tokens(head, rows) if batched else [solo_next_token(head, row) for row in rows]
        for token in tokens:
            head.embed([token])
    return len(rows) * rounds / (time.perf_counter() - started)


def near_tie_share(head, rows: list[HeadRow]) -> float:
    """Share of rows whose batched best two logits lie within twice their bound (recomputed alone)."""
    logits, bounds = head.batch_logits([row.hidden_states for row in rows])
    top_two = torch.topk(logits, 2, dim=1).values
    return float(((top_two[:, 0] - top_two[:, 1]) <= 2 * bounds).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama-250m")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each; the best counts (a shared "
                        "machine's neighbours only ever slow a run down)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--quantize", default="none", help="the mesh's scheme (none, int8, int4/g32, ...)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = random_checkpoint(args.model) if args.model.startswith("random:") else args.model
    head = load_head(path, quantization=args.quantize)
    generator = torch.Generator().manual_seed(0)
    print(f"{args.model} head on cpu ({torch.get_num_threads()} threads), lm_head {type(head._lm_head).__name__}")
    print("sessions  one-by-one steps/s  batched steps/s  speed-up")
    for sessions in (1, 2, 4, 8):
        rows = [HeadRow(torch.randn(1, 1, head.info.hidden_size, generator=generator), GREEDY)
                for _ in range(sessions)]
        one_by_one = batched = 0.0
        for _ in range(args.repeats):
            one_by_one = max(one_by_one, steps_per_second(head, rows, args.rounds, False))
            batched = max(batched, steps_per_second(head, rows, args.rounds, True))
        print(f"{sessions:8d}  {one_by_one:18.1f}  {batched:15.1f}  {batched / one_by_one:8.2f}")
    sample = [HeadRow(torch.randn(1, 1, head.info.hidden_size, generator=generator), GREEDY) for _ in range(256)]
    print(f"near ties recomputed alone: {near_tie_share(head, sample):.1%} of rows")


if __name__ == "__main__":
    main()
