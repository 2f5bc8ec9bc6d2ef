"""What the OpenAI-compatible gateway adds to a streamed answer: time to first token and decode tokens/s of the same
greedy request asked the way `hearth chat` asks (services.common.chat_client over NATS) and through `hearth gateway`
with the official `openai` client (streamed), interleaved round by round on one running mesh (3 shard hosts, an
orchestrator, the gateway: real processes, a secure community mesh as `hearth demo` runs it).

Both are measured at the client: TTFT from the call to its first text, decode tokens/s over the text chunks after
the first (the same tokens both ways). A last part starts N streaming clients at once through the gateway and
counts how many got a complete answer (the orchestrator queues what it cannot run yet).

    .venv/bin/python scripts/bench_gateway.py --rounds 20 --max-tokens 64 --concurrent 100
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai  # noqa: E402

from services.cluster import LocalCluster, even_layer_ranges  # noqa: E402
from services.common.chat_client import stream_chat  # noqa: E402
from services.common.chat_protocol import ChatMessage, ChatRequest, TokenDeltaFrame  # noqa: E402
from services.common.lifecycle import run_event_loop  # noqa: E402
from services.common.nats_connection import connect_nats  # noqa: E402
from services.demo import resolve_demo_model  # noqa: E402
from services.gateway.keys import create_api_key  # noqa: E402

PROMPT = "Tell me a fortune."
MEMBER = "bench-user"


def rates(started: float, arrivals: list[float]) -> tuple[float, float]:
    """(TTFT ms, decode tokens/s) from the call's start and each text chunk's arrival."""
    ttft_ms = (arrivals[0] - started) * 1000.0
    decode_s = arrivals[-1] - arrivals[0]
    return ttft_ms, (len(arrivals) - 1) / decode_s if decode_s > 0 else float("nan")


async def over_nats(nc, request: ChatRequest) -> tuple[float, float, int]:
    started = time.perf_counter()
    arrivals = []
    async for frame in stream_chat(nc, request.model_copy(update={"request_id": f"b{time.monotonic_ns()}"})):
        if isinstance(frame, TokenDeltaFrame) and frame.text:
            arrivals.append(time.perf_counter())
    return (*rates(started, arrivals), len(arrivals))


async def over_gateway(client: openai.AsyncOpenAI, model: str, max_tokens: int) -> tuple[float, float, int]:
    started = time.perf_counter()
    arrivals = []
    stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                                  temperature=0, max_tokens=max_tokens, stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
    return (*rates(started, arrivals), len(arrivals))


async def concurrent_clients(client: openai.AsyncOpenAI, model: str, count: int) -> tuple[int, float]:
    async def one() -> bool:
        try:
            answer = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=16,
                stream=True)
            return [chunk async for chunk in answer][-1].choices[0].finish_reason in ("stop", "length")
        except openai.APIError as error:
            print(f"refused: {error}", file=sys.stderr)
            return False

    started = time.perf_counter()
    served = await asyncio.gather(*(one() for _ in range(count)))
    return sum(served), time.perf_counter() - started


async def measure(cluster: LocalCluster, url: str, api_key: str, model: str, args) -> None:
    nc = await connect_nats(cluster.nats_url, name="bench-chat",
                            settings=cluster.nats_settings(cluster.member_key(MEMBER, "client")))
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=600)
    request = ChatRequest(model=model, messages=[ChatMessage(role="user", content=PROMPT)], max_tokens=args.max_tokens)
    results: dict[str, list[tuple[float, float, int]]] = {"hearth chat (NATS)": [], "gateway (openai, SSE)": []}
    try:
        for _ in range(args.warmup):
            await over_nats(nc, request)
            await over_gateway(client, model, args.max_tokens)
        for round_index in range(args.rounds):
            # Interleaved, and the order alternates, so drift in the machine's load hits both alike.
            pair = [("hearth chat (NATS)", over_nats(nc, request)),
                    ("gateway (openai, SSE)", over_gateway(client, model, args.max_tokens))]
            for name, work in pair if round_index % 2 == 0 else reversed(pair):
                results[name].append(await work)
        print("| path | rounds | tokens | TTFT median ms | TTFT p90 ms | decode tokens/s median |")
        print("|---|---:|---:|---:|---:|---:|")
        medians = {}
        for name, rows in results.items():
            ttfts, decode = sorted(r[0] for r in rows), [r[1] for r in rows]
            medians[name] = (statistics.median(ttfts), statistics.median(decode))
            print(f"| {name} | {len(rows)} | {rows[0][2]} | {medians[name][0]:.2f} | "
                  f"{ttfts[int(0.9 * (len(ttfts) - 1))]:.2f} | {medians[name][1]:.1f} |")
        (chat_ttft, chat_rate), (gw_ttft, gw_rate) = medians.values()
        print(f"\ngateway adds {gw_ttft - chat_ttft:+.2f} ms to the median TTFT and changes the median decode rate "
              f"by {100.0 * (gw_rate - chat_rate) / chat_rate:+.2f} %")
        if args.concurrent:
            served, seconds = await concurrent_clients(client, model, args.concurrent)
            print(f"{args.concurrent} concurrent streaming clients: {served} answered completely in {seconds:.1f} s")
    finally:
        await client.close()
        await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="as `hearth demo --model` (default: the bundled model)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrent", type=int, default=0, help="then N streaming clients at once (0: skip)")
    args = parser.parse_args()
    model = resolve_demo_model(args.model)
    with LocalCluster(torch_threads=1) as cluster:
        cluster.start_nats()
        for index, (lo, hi) in enumerate(even_layer_ranges(model.num_layers, 3)):
            cluster.start_shard(str(model.path), lo, hi, node_id=f"bench-host-{index}", wait_ready=False)
        cluster.start_orchestrator(extra_args=["--preload", str(model.path)], wait_ready=False)
        cluster.wait_all_ready()
        api_key = create_api_key(cluster.member_key(MEMBER, "client").parents[1], MEMBER)
        url = cluster.start_gateway().ready_file.read_text()
        run_event_loop(measure(cluster, url, api_key, model.name, args))


if __name__ == "__main__":
    main()
