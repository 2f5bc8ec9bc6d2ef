"""Measures whether re-prefilling gives a call the tokens it would have had: greedy tokens of an uninterrupted run
against a run whose caches were rebuilt mid-generation by one prefill of the prompt plus the tokens so far (what the
orchestrator does after a failover), and a prompt prefilled in the orchestrator's chunks against one whole prefill
(what generate() does).

In one process, with hearth's layer runner and head over every layer of a `random:<shape>` checkpoint (or a model
path), for the bench's prompts (hearth/services/devtools/bench/prompts.py) of each variant:

    .venv/bin/python scripts/measure_reprefill_parity.py --model random:llama-250m --quantize int8 \
        --prompt-tokens 64 --failover-at 20 --new-tokens 40 --prompts 8

Prints, per prompt, how many tokens of the two runs agree before they part (the whole run: they never do).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hearth.inference import load_head, load_layer_range
from hearth.inference.sampling import SamplingParams
from hearth.services.common.config_processes import OrchestratorSettings
from hearth.services.devtools.bench.prompts import build_prompt
from hearth.services.devtools.random_models import RANDOM_PREFIX, random_checkpoint

GREEDY = SamplingParams(temperature=0.0)


class Generation:
    """Greedy generation over one runner holding every layer, one session at a time."""

    def __init__(self, runner, head, chunk_tokens: int) -> None:
        self.runner, self.head, self.chunk_tokens = runner, head, chunk_tokens

    def prefill(self, session: str, ids: list[int], chunk_tokens: int) -> torch.Tensor:
        position, output = 0, None
        while position < len(ids):
            part = ids[position:position + (chunk_tokens or len(ids))]
            output = self.runner.forward(session, self.head.embed(part), position, "prefill")
            position += len(part)
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

    def failed_over(self, ids: list[int], tokens: list[int], failover_at: int, new_tokens: int) -> list[int]:
        """Re-prefill the prompt and the tokens before the one last sampled, then decode the rest from it."""
        known = ids + tokens[:failover_at - 1]
        self.prefill("again", known, self.chunk_tokens)
        again = self.decode("again", list(tokens[:failover_at]), len(known), new_tokens)
        self.runner.reset("again")
        return again


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
    print(f"{args.model}, {args.quantize}, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens; "
          f"tokens agreeing before the runs part (of {args.new_tokens})")
    print(f"| prompt | failed over at {args.failover_at} | {chunk_tokens}-token chunks vs one prefill |")
    print("|---:|---:|---:|")
    for variant in range(args.prompts):
        _, ids = build_prompt(head.tokenizer, path, args.prompt_tokens, variant)
        tokens = generation.run(ids, args.new_tokens, chunk_tokens)
        again = generation.failed_over(ids, tokens, args.failover_at, args.new_tokens)
        whole = generation.run(ids, args.new_tokens, 0)
        print(f"| {variant} | {agreeing(tokens, again)} | {agreeing(tokens, whole)} |", flush=True)


if __name__ == "__main__":
    main()
