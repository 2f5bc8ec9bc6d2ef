"""How fast can any 3-process pipeline decode on this machine? Rings of bare processes vs one process.

Runs greedy decode of a `random:<shape>` checkpoint (services.devtools.random_models) three ways, with hearth's layer
runner and head but none of hearth's services:

- ``mono``: one process runs the head and all layers (what generate() does, minus its overhead);
- ``pipe``: the head process and 3 layer-range processes pass hidden states round a ring of OS pipes,
  each computing on its main thread: the least any multi-process pipeline can add here;
- ``nats``: the same ring through a nats-server with nats-py on uvloop, torch on one worker thread per
  process (inference.compute_thread), no acks, checks or bookkeeping: the least a NATS pipeline can add.

The gap between ``pipe`` and ``mono`` is what splitting a model across processes costs on this machine
before any transport; the gap between ``nats`` and hearth's pipeline is what hearth's own code costs.

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=20000 .venv/bin/python scripts/bench_ring_ceiling.py \
        --shape llama-250m --modes mono pipe nats --rounds 3 [--quantize int8|int4]

``--quantize`` gives every process the layers and head a shard and an orchestrator load under that scheme.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import struct
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

prompt_tokens = 64
frame_header = struct.Struct("ii")  # (position of the first token, number of tokens); n < 0 stops


def read_hidden(message: bytes, hidden_size: int):
    """A ring frame's hidden states ``[1, tokens, hidden_size]`` and where the compute trailer starts."""
    import torch

    tokens = frame_header.unpack_from(message)[1]
    hidden_end = frame_header.size + tokens * hidden_size * 4
    hidden = torch.frombuffer(bytearray(message[frame_header.size:hidden_end]), dtype=torch.float32)
    return hidden.view(1, tokens, hidden_size), hidden_end


def stage_step(runner, message: bytes) -> bytes | None:
    """Run one ring frame through a layer range, appending its compute seconds; None for the stop frame."""
    started = time.perf_counter()
    pos, tokens = frame_header.unpack_from(message)
    if tokens < 0:
        return None
    hidden, hidden_end = read_hidden(message, runner.info.hidden_size)
    if pos == 0:
        runner.reset("ring")
    output = runner.forward("ring", hidden, pos, "prefill" if tokens > 1 else "decode")
    output_bytes = output.contiguous().numpy().tobytes()
    compute_s = struct.pack("d", time.perf_counter() - started)
    return message[:frame_header.size] + output_bytes + message[hidden_end:] + compute_s


def load_stage(path: str, lo: int, hi: int, threads: int, quantization: str):
    import torch

    from hearth.inference import load_layer_range
    from hearth.services.common.config_processes import ShardSettings

    torch.set_num_threads(threads)
    shard = ShardSettings()  # the KV limits a shard has by default
    return load_layer_range(path, lo, hi, cache_budget_bytes=shard.kv_cache_budget_bytes,
                            session_ttl_s=shard.eviction_idle_s, quantization=quantization)


def pipe_stage(path: str, lo: int, hi: int, threads: int, quantization: str, inbound, outbound) -> None:
    runner = load_stage(path, lo, hi, threads, quantization)
    while (reply := stage_step(runner, message := inbound.recv_bytes())) is not None:
        outbound.send_bytes(reply)
    outbound.send_bytes(message)


def nats_stage(path: str, lo: int, hi: int, threads: int, quantization: str, url: str, index: int) -> None:
    from hearth.inference.compute_thread import on_compute_thread
    from hearth.services.common.lifecycle import run_event_loop

    async def serve() -> None:
        import nats

        # Loaded on the compute thread, as a shard does: a second OpenMP team (quantizing on the main thread)
        # would stop libgomp from spinning.
        runner = await on_compute_thread(load_stage, path, lo, hi, threads, quantization)
        nc = await nats.connect(url)
        stopped = asyncio.Event()

        async def on_frame(msg) -> None:
            reply = await on_compute_thread(stage_step, runner, msg.data)
            await nc.publish(f"ring.{index + 1}", reply if reply is not None else msg.data)
            if reply is None:
                stopped.set()

        await nc.subscribe(f"ring.{index}", cb=on_frame)
        await nc.flush()
        await nc.publish("ring.ready", b"")
        await asyncio.wait_for(stopped.wait(), 3600)
        await nc.flush()
        await nc.close()

    run_event_loop(serve())


class Head:
    """Embeds, sends into the ring, takes the last stage's output and picks the next token greedily.

    `compute_s` adds up the seconds spent computing (here and, from the frames' trailers, in every stage)
    since it was last reset, so a step's time minus it is what passing the frames round cost.
    """

    def __init__(self, path: str, threads: int, quantization: str) -> None:
        import torch

        from hearth.inference import load_head

        torch.set_num_threads(threads)
        self.head = load_head(path, load_tokenizer=False, quantization=quantization)
        self.compute_s = 0.0

    def frame(self, token_ids: list[int], pos: int) -> bytes:
        started = time.perf_counter()
        hidden = self.head.embed(token_ids).contiguous()
        message = frame_header.pack(pos, len(token_ids)) + hidden.numpy().tobytes()
        self.compute_s += time.perf_counter() - started
        return message

    def next_token(self, message: bytes) -> int:
        started = time.perf_counter()
        hidden, hidden_end = read_hidden(message, self.head.info.hidden_size)
        token = int(self.head.logits(hidden).argmax())
        self.compute_s += sum(struct.unpack(f"{(len(message) - hidden_end) // 8}d", message[hidden_end:]))
        self.compute_s += time.perf_counter() - started
        return token


@dataclass
class Generation:
    """One timed generation: decode tokens/s and, per token, the seconds not spent computing."""

    tokens_per_s: float
    overhead_s: list[float]
    # Tokens over the sum of the step times (hearth bench's way: a slow token counts in full).
    mean_tokens_per_s: float = 0.0


async def timed_generation(step, head: Head, new_tokens: int) -> Generation:
    """Greedy decode of `new_tokens`; `await step(ids, pos)` returns the next token."""
    token = await step(list(range(5, 5 + prompt_tokens)), 0)
    times, overheads = [], []
    for index in range(new_tokens):
        head.compute_s = 0.0
        started = time.perf_counter()
        token = await step([token], prompt_tokens + index)
        times.append(time.perf_counter() - started)
        overheads.append(times[-1] - head.compute_s)
    return Generation(1.0 / statistics.median(times), overheads, len(times) / sum(times))


async def timed_generations(step, head: Head, rounds: int, new_tokens: int) -> list[Generation]:
    return [await timed_generation(step, head, new_tokens) for _ in range(rounds)]


def run_mono(path: str, ranges, threads: int, quantization: str, rounds: int,
             new_tokens: int) -> list[Generation]:
    head = Head(path, threads, quantization)
    runner = load_stage(path, 0, ranges[-1][1], threads, quantization)

    async def step(token_ids: list[int], pos: int) -> int:
        return head.next_token(stage_step(runner, head.frame(token_ids, pos)))

    return asyncio.run(timed_generations(step, head, rounds, new_tokens))


def run_pipe(path: str, ranges, threads: int, quantization: str, rounds: int,
             new_tokens: int) -> list[Generation]:
    context = mp.get_context("spawn")
    pipes = [context.Pipe(duplex=False) for _ in range(len(ranges) + 1)]  # pipe i feeds stage i
    stages = [context.Process(target=pipe_stage,
                              args=(path, lo, hi, threads, quantization, pipes[i][0], pipes[i + 1][1]))
              for i, (lo, hi) in enumerate(ranges)]
    for stage in stages:
        stage.start()
    head = Head(path, threads, quantization)

    async def step(token_ids: list[int], pos: int) -> int:
        pipes[0][1].send_bytes(head.frame(token_ids, pos))
        return head.next_token(pipes[-1][0].recv_bytes())

    try:
        return asyncio.run(timed_generations(step, head, rounds, new_tokens))
    finally:
        pipes[0][1].send_bytes(frame_header.pack(0, -1))
        for stage in stages:
            stage.join(30)


def run_nats(path: str, ranges, threads: int, quantization: str, rounds: int,
             new_tokens: int) -> list[Generation]:
    from hearth.inference.compute_thread import on_compute_thread
    from hearth.services.common.lifecycle import run_event_loop
    from hearth.services.broker.server import EmbeddedNatsServer

    context = mp.get_context("spawn")
    with EmbeddedNatsServer() as server:
        stages = [context.Process(target=nats_stage, args=(path, lo, hi, threads, quantization, server.url, i))
                  for i, (lo, hi) in enumerate(ranges)]
        for stage in stages:
            stage.start()

        async def drive() -> list[Generation]:
            import nats

            head = await on_compute_thread(Head, path, threads, quantization)
            nc = await nats.connect(server.url)
            outputs: asyncio.Queue[bytes] = asyncio.Queue()
            ready: asyncio.Queue[bytes] = asyncio.Queue()

            async def on_output(msg) -> None:
                outputs.put_nowait(msg.data)

            async def on_ready(msg) -> None:
                ready.put_nowait(msg.data)

            await nc.subscribe(f"ring.{len(ranges)}", cb=on_output)
            await nc.subscribe("ring.ready", cb=on_ready)
            await nc.flush()
            for _ in ranges:  # frames published before a stage subscribes would be lost
                await asyncio.wait_for(ready.get(), 600)

            async def step(token_ids: list[int], pos: int) -> int:
                await nc.publish("ring.0", await on_compute_thread(head.frame, token_ids, pos))
                return await on_compute_thread(head.next_token, await asyncio.wait_for(outputs.get(), 600))

            generations = await timed_generations(step, head, rounds, new_tokens)
            await nc.publish("ring.0", frame_header.pack(0, -1))
            await asyncio.wait_for(outputs.get(), 30)
            await nc.close()
            return generations

        try:
            return run_event_loop(drive())
        finally:
            for stage in stages:
                stage.join(30)


def run_mode(mode: str, *args) -> list[Generation]:
    return {"mono": run_mono, "pipe": run_pipe, "nats": run_nats}[mode](*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-250m", help="a services.devtools.random_models shape")
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of every process")
    parser.add_argument("--modes", nargs="+", choices=["mono", "pipe", "nats"], default=["mono", "pipe", "nats"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--quantize", default="none", help="the layers' and head's scheme: none, int8, int4[/gN]")
    args = parser.parse_args()

    from transformers import AutoConfig

    from hearth.services.devtools.random_models import random_checkpoint
    from hearth.services.devtools.local_cluster import even_layer_ranges

    path = str(random_checkpoint(f"random:{args.shape}"))
    ranges = even_layer_ranges(AutoConfig.from_pretrained(path).num_hidden_layers, args.shards)
    context = mp.get_context("spawn")
    results = {}
    for mode in args.modes:
        # Each mode in a fresh process: a second OpenMP team left behind (the nats head's compute thread)
        # would stop libgomp from spinning in the next mode.
        with ProcessPoolExecutor(1, mp_context=context) as pool:  # not daemonic: it may start stages
            generations = pool.submit(run_mode, mode, path, ranges, args.threads, args.quantize, args.rounds,
                                      args.new_tokens).result()
        rates = [generation.tokens_per_s for generation in generations]
        results[mode] = statistics.median(rates)
        # Per leg: a token crosses len(ranges) + 1 legs (head -> stage 0 -> ... -> head); mono has none.
        legs = len(ranges) + 1 if mode != "mono" else 1
        per_leg_ms = sorted(o * 1000.0 / legs for g in generations for o in g.overhead_s)
        p50, p95 = (per_leg_ms[int(q * (len(per_leg_ms) - 1))] for q in (0.5, 0.95))
        print(f"{mode:5s} {' '.join(f'{rate:6.2f}' for rate in rates)} tok/s (median {results[mode]:.2f}); "
              f"not computing, per {'leg' if mode != 'mono' else 'token'}: p50 {p50:.3f} ms, p95 {p95:.3f} ms",
              flush=True)
    if "mono" in results:
        for mode in ("pipe", "nats"):
            if mode in results:
                print(f"{mode} / mono: {results[mode] / results['mono']:.3f}")


if __name__ == "__main__":
    main()
