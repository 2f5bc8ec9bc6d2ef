"""Measures how far honest computations of the same layers on the same inputs differ, per activation dtype and weight
scheme, against what the shard faults make; prints one JSON object (BENCHMARKS.md, "Honest shards: tolerances").

For each (dtype, scheme) and each round, a batch of 2..8 sessions (cycling) with prompts of different lengths gets
its positions' outputs computed as: (a) the reference, one prefill of all of a session's positions (what a verifier
replica runs); (b) the first session alone: its prompt prefilled in chunks, each run a layer per turn in pieces of
tokens (a shard's sliced prefill), then one decode step per position; (c) every session: the prompts as one batched
prefill, then batched decode steps of all the sessions' rows (`step_batch`, as hearth/services/shard/compute.py runs them);
(d) (b)'s and (c)'s outputs after a round trip through each wire dtype (bf16, fp16, int8 blocks). Errors are
`inference.activation_compare.position_errors` against (a), one per position. The faults' rows are the smallest
and median error each fault spec makes on the reference outputs (hearth/services/shard/faults.py).

Inputs are the embeddings of random tokens (also for a range that does not start at layer 0).
Usage: python scripts/measure_honest_tolerance.py [--model random:llama-250m] [--layers 0-3]
[--dtypes float32,bfloat16] [--schemes none,int8,int4] [--rounds 7] [--decode-steps 32] [--threads 2] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hearth.inference.activation_compare import position_errors  # noqa: E402
from hearth.inference.batched import BatchRow  # noqa: E402
from hearth.inference.loading import load_layer_range  # noqa: E402
from hearth.services.common.config import TransportSettings  # noqa: E402
from hearth.services.common.config_processes import ShardSettings  # noqa: E402
from hearth.services.devtools.random_models import RANDOM_PREFIX, random_checkpoint  # noqa: E402
from hearth.services.shard.faults import ShardFault  # noqa: E402
from hearth.services.transport.wire import WireDtype, decode_payload, encode_payload  # noqa: E402

FAULT_SPECS = ("scale=1.01", "noise=0.01", "offset=0.1", "bitflip=30", "bitflip=23")
WIRE_DTYPES = (WireDtype.bfloat16, WireDtype.float16, WireDtype.int8)
smallest_batch, largest_batch = 2, 8
prompt_tokens_range = (8, 96)
prefill_chunk_range = (8, 40)
prefill_piece_tokens = 16


def embedding_rows(path: Path) -> torch.Tensor:
    """The checkpoint's input embedding matrix (single-file or sharded safetensors)."""
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():
                if name.endswith("embed_tokens.weight"):
                    return tensors.get_tensor(name).float()
    raise SystemExit(f"no embed_tokens.weight in the safetensors of {path}")


def wire_round_trip(tensor: torch.Tensor, wire: WireDtype, int8_block: int) -> torch.Tensor:
    """The tensor a receiver restores after `tensor` travelled as `wire` (hearth/services/transport/wire.py)."""
    wire_dtype, compute, block, _owner, view = encode_payload(tensor.cpu().contiguous(), wire, int8_block)
    return decode_payload(wire_dtype, compute, tuple(tensor.shape), block, bytearray(view))


class Errors:
    """Per-position errors of one (dtype, scheme), by how the outputs were computed."""

    def __init__(self) -> None:
        self.by_path: dict[str, list[torch.Tensor]] = {}

    def add(self, path: str, claimed: torch.Tensor, reference: torch.Tensor) -> None:
        self.by_path.setdefault(path, []).append(position_errors(claimed.cpu(), reference.cpu()))

    def summary(self) -> dict[str, dict[str, float]]:
        figures = {}
        for path, parts in self.by_path.items():
            errors = torch.cat(parts).double()
            figures[path] = {"positions": int(errors.numel()), "max": float(errors.max()),
                             "p99.99": float(torch.quantile(errors, 0.9999)), "median": float(errors.median()),
                             "min": float(errors.min())}
        return figures


def session_inputs(embeddings: torch.Tensor, draws: random.Random, tokens: int, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    ids = torch.tensor([draws.randrange(embeddings.shape[0]) for _ in range(tokens)])
    return embeddings[ids].unsqueeze(0).to(device=device, dtype=dtype)


def chunked_then_decoded(runner, session_id: str, inputs: torch.Tensor, prompt_tokens: int,
                         draws: random.Random) -> torch.Tensor:
    """Path (b): the prompt in chunks (a layer per turn, in pieces), then one decode step per position."""
    outputs, position = [], 0
    while position < prompt_tokens:
        chunk = min(draws.randint(*prefill_chunk_range), prompt_tokens - position)
        step = runner.begin_forward(session_id, inputs[:, position:position + chunk], position, "prefill")
        output = None
        while output is None:
            output = runner.advance(step, 1, prefill_piece_tokens)
        outputs.append(output)
        position += chunk
    for position in range(prompt_tokens, inputs.shape[1]):
        outputs.append(runner.forward(session_id, inputs[:, position:position + 1], position, "decode"))
    runner.reset(session_id)
    return torch.cat(outputs, dim=1)


def batched(runner, session_ids: list[str], inputs: list[torch.Tensor], prompts: list[int]) -> list[torch.Tensor]:
    """Path (c): every session's prompt in one batched prefill, then batched decode steps of all the rows."""
    rows = [BatchRow(sid, x[:, :p], 0, "prefill") for sid, x, p in zip(session_ids, inputs, prompts, strict=True)]
    outputs = [[out] for out in _each(runner.step_batch(rows))]
    decode_steps = inputs[0].shape[1] - prompts[0]
    for step in range(decode_steps):
        rows = [BatchRow(sid, x[:, p + step:p + step + 1], p + step, "decode")
                for sid, x, p in zip(session_ids, inputs, prompts, strict=True)]
        for collected, out in zip(outputs, _each(runner.step_batch(rows)), strict=True):
            collected.append(out)
    for session_id in session_ids:
        runner.reset(session_id)
    return [torch.cat(parts, dim=1) for parts in outputs]


def _each(results: list) -> list[torch.Tensor]:
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results


def measure(runner, embeddings: torch.Tensor, dtype: torch.dtype, args, int8_block: int) -> dict:
    errors, fault_errors = Errors(), Errors()
    draws = random.Random(args.seed)
    for round_index in range(args.rounds):
        batch = smallest_batch + round_index % (largest_batch - smallest_batch + 1)
        prompts = [draws.randint(*prompt_tokens_range) for _ in range(batch)]
        inputs = [session_inputs(embeddings, draws, p + args.decode_steps, dtype, runner.device) for p in prompts]
        session_ids = [f"round{round_index}-row{row}" for row in range(batch)]
        references = []
        for session_id, x in zip(session_ids, inputs, strict=True):
            references.append(runner.forward(session_id, x, 0, "prefill"))
            runner.reset(session_id)
        solo = chunked_then_decoded(runner, session_ids[0], inputs[0], prompts[0], draws)
        errors.add("chunked+decode", solo, references[0])
        for wire in WIRE_DTYPES:
            errors.add(f"chunked+decode, {wire.value} wire", wire_round_trip(solo, wire, int8_block), references[0])
        for rows, reference in zip(batched(runner, session_ids, inputs, prompts), references, strict=True):
            errors.add("batched", rows, reference)
            for wire in WIRE_DTYPES:
                errors.add(f"batched, {wire.value} wire", wire_round_trip(rows, wire, int8_block), reference)
        for reference in (reference.cpu() for reference in references):
            for spec in FAULT_SPECS:
                fault = ShardFault.parse(f"{spec},fault_seed={args.seed + round_index}")
                fault_errors.add(spec, fault.corrupt(reference), reference)
    return {"honest": errors.summary(), "faults": fault_errors.summary()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama-250m")
    parser.add_argument("--layers", default="0-3", help="the inclusive layer range lo-hi a shard holds")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--schemes", default="none,int8,int4")
    parser.add_argument("--rounds", type=int, default=7, help="batches of sessions per (dtype, scheme)")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the layers run (cpu, cuda)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = random_checkpoint(args.model) if args.model.startswith(RANDOM_PREFIX) else Path(args.model)
    lo, hi = (int(bound) for bound in args.layers.split("-"))
    shard = ShardSettings()  # the KV limits a shard has by default
    int8_block = TransportSettings().int8_block_elems
    embeddings = embedding_rows(path)
    results = {"model": args.model, "layers": args.layers, "rounds": args.rounds, "decode_steps": args.decode_steps,
               "threads": args.threads, "device": args.device, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
               "configurations": {}}
    for dtype_name in args.dtypes.split(","):
        for scheme in args.schemes.split(","):
            started = time.perf_counter()
            runner = load_layer_range(path, lo, hi, dtype=dtype_name, quantization=scheme, device=args.device,
                                      cache_budget_bytes=shard.kv_cache_budget_bytes,
                                      session_ttl_s=shard.eviction_idle_s)
            with runner:
                figures = measure(runner, embeddings, getattr(torch, dtype_name), args, int8_block)
            figures["seconds"] = round(time.perf_counter() - started, 1)
            results["configurations"][f"{dtype_name} {runner.quantization}"] = figures
            print(f"{dtype_name} {scheme}: {figures['seconds']} s", file=sys.stderr, flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
