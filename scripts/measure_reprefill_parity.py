"""Measures whether re-prefilling gives a call the tokens it would have had: greedy tokens of an uninterrupted run
against a run whose caches were rebuilt mid-generation from the prompt and the tokens so far, the way the
orchestrator re-prefills after a failover (the prompt in its chunks, the decoded tokens as replay steps:
hearth/services/orchestrator/prefill.py) and as plain prefill chunks; and a prompt prefilled in the orchestrator's
chunks against one whole prefill (what generate() does).

In one process, with hearth's layer runner and head over every layer of a `random:<shape>` checkpoint (or a model
path), for the bench's prompts (hearth/services/devtools/bench/prompts.py) of each variant:

    .venv/bin/python scripts/measure_reprefill_parity.py --model random:llama-250m --quantize int8 \
        --prompt-tokens 64 --failover-at 20 --new-tokens 40 --prompts 8

Prints, per prompt, how many tokens of the two runs agree before they part (the whole run: they never do). With
`--cost-tokens 32,256,512` it first prints what re-prefilling that many decoded tokens after the prompt costs, as
replay steps and as one prefill step (the best of 3 each).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from hearth.inference import load_head, load_layer_range
from hearth.inference.sampling import SamplingParams
from hearth.services.common.config_processes import OrchestratorSettings
from hearth.services.devtools.bench.prompts import build_prompt
from hearth.services.devtools.random_models import RANDOM_PREFIX, random_checkpoint
from hearth.services.orchestrator.prefill import step_spans

GREEDY = SamplingParams(temperature=0.0)


class Generation:
    """Greedy generation over one runner holding every layer, one session at a time."""

    def __init__(self, runner, head, chunk_tokens: int) -> None:
        self.runner, self.head, self.chunk_tokens = runner, head, chunk_tokens

    def prefill(self, session: str, ids: list[int], chunk_tokens: int, replay_from: int | None = None) -> torch.Tensor:
        """`ids` in the orchestrator's steps (prefill.step_spans): chunks, those from `replay_from` on replayed."""
        hidden, output = self.head.embed(ids), None
        for first, end, kind in step_spans(len(ids), chunk_tokens, 0, replay_from):
            output = self.runner.forward(session, hidden[:, first:end], first, kind.value)
        return output

    def decode(self, session: str, tokens: list[int], position: int, new_tokens: int) -> list[int]:
        while len(tokens) < new_tokens:
            output = self.runner.forward(session, self.head.embed([tokens[-1]]), position, "decode")
            position += 1
            tokens.append(self.head.sample(self.head.logits(output), GREEDY))
        return tokens

    def run(self, ids: list[int], new_tokens: int, chunk_tokens: int) -> list[int]:
        first = self.head.sample(self.head.logits(self.prefill("run", ids, chunk_tokens)), GREEDY)
        tokens = self.decode("run", [first], len(ids), new_tokens)
        self.runner.reset("run")
        return tokens

    def failed_over(self, ids: list[int], tokens: list[int], failover_at: int, new_tokens: int,
                    replay: bool) -> list[int]:
        """Re-prefill the prompt and the tokens before the one last sampled (those as replay steps, or as prefill
        chunks), then decode the rest from it."""
        known = ids + tokens[:failover_at - 1]
        self.prefill("again", known, self.chunk_tokens, len(ids) if replay else None)
        again = self.decode("again", list(tokens[:failover_at]), len(known), new_tokens)
        self.runner.reset("again")
        return again


def reprefill_costs(runner, head, ids: list[int], decoded_tokens: int) -> dict[str, float]:
    """Seconds (best of 3) to re-prefill `decoded_tokens` positions after the prompt `ids`, per step kind."""
    hidden = head.embed((ids * (1 + decoded_tokens // len(ids) + 1))[:len(ids) + decoded_tokens])
    costs = {}
    for kind in ("replay", "prefill"):
        best = float("inf")
        for _ in range(3):
            runner.forward("cost", hidden[:, :len(ids)], 0, "prefill")
            started = time.perf_counter()
            runner.forward("cost", hidden[:, len(ids):], len(ids), kind)
            best = min(best, time.perf_counter() - started)
            runner.reset("cost")
        costs[kind] = best
    return costs


def agreeing(first: list[int], second: list[int]) -> int:
    return next((index for index, (a, b) in enumerate(zip(first, second, strict=True)) if a != b), len(first))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama-250m")
    parser.add_argument("--quantize", default="none", help="none, int8 or int4[/gN] (layers and head)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--failover-at", type=int, default=20, help="tokens streamed before the failover")
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=8, help="prompt variants")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cost-tokens", default="", help="comma-separated decoded-token counts to time re-prefills of")
    args = parser.parse_args()
    if not 1 <= args.failover_at < args.new_tokens:
        parser.error("--failover-at must lie between 1 and --new-tokens")
    torch.set_num_threads(args.threads)
    path = random_checkpoint(args.model) if args.model.startswith(RANDOM_PREFIX) else Path(args.model)
    head = load_head(path, quantization=args.quantize)
    runner = load_layer_range(path, 0, head.info.num_layers - 1, quantization=args.quantize,
                              cache_budget_bytes=4 << 30, session_ttl_s=3600.0)
    chunk_tokens = OrchestratorSettings().prefill_chunk_tokens
    generation = Generation(runner, head, chunk_tokens)
    for decoded_tokens in (int(count) for count in args.cost_tokens.split(",") if count):
        _, ids = build_prompt(head.tokenizer, path, args.prompt_tokens, 0)
        costs = reprefill_costs(runner, head, ids, decoded_tokens)
        print(f"re-prefill of {decoded_tokens} decoded tokens after {len(ids)}: replay steps "
              f"{costs['replay'] * 1000:.0f} ms, one prefill step {costs['prefill'] * 1000:.0f} ms", flush=True)
    print(f"{args.model}, {args.quantize}, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens; "
          f"tokens agreeing before the runs part (of {args.new_tokens})")
    print(f"| prompt | failed over at {args.failover_at}, replayed | failed over at {args.failover_at}, prefilled | "
          f"{chunk_tokens}-token chunks vs one prefill |")
    print("|---:|---:|---:|---:|")
    for variant in range(args.prompts):
        _, ids = build_prompt(head.tokenizer, path, args.prompt_tokens, variant)
        tokens = generation.run(ids, args.new_tokens, chunk_tokens)
        replayed = generation.failed_over(ids, tokens, args.failover_at, args.new_tokens, replay=True)
        prefilled = generation.failed_over(ids, tokens, args.failover_at, args.new_tokens, replay=False)
        whole = generation.run(ids, args.new_tokens, 0)
        print(f"| {variant} | {agreeing(tokens, replayed)} | {agreeing(tokens, prefilled)} | "
              f"{agreeing(tokens, whole)} |", flush=True)


if __name__ == "__main__":
    main()
