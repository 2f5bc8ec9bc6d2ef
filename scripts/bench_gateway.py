"""What the OpenAI-compatible gateway adds to a streamed answer: time to first token and decode tokens/s of the same
greedy request asked the way `hearth chat` asks (services.client.chat over NATS) and through `hearth gateway`
with the official `openai` client (streamed), interleaved round by round on one running mesh (3 shard hosts, an
orchestrator, the gateway: real processes, a secure community mesh as `hearth demo` runs it).

All are measured at the client: TTFT from the call to its first text, decode tokens/s over the text chunks after
the first (the same tokens every way). The gateway is asked twice: with the `openai` client (what users run; its
own request building and chunk parsing count too) and with a bare HTTP client (httpx2 on a kept-alive connection,
SSE lines split by hand), which leaves the gateway's own cost. A last part starts N streaming clients at once through the gateway and
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

import httpx2  # noqa: E402
import openai  # noqa: E402

from hearth.services.devtools.local_cluster import LocalCluster  # noqa: E402
from hearth.services.client.chat import stream_chat  # noqa: E402
from hearth.protocol.chat import ChatMessage, ChatRequest  # noqa: E402
from hearth.protocol.chat_frames import TokenDeltaFrame  # noqa: E402
from hearth.services.common.lifecycle import run_event_loop  # noqa: E402
from hearth.services.broker.connection import connect_nats  # noqa: E402
from hearth.services.devtools.demo import default_shards, resolve_demo_model  # noqa: E402
from hearth.services.gateway.keys import create_api_key  # noqa: E402

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


async def over_bare_http(http: httpx2.AsyncClient, model: str, max_tokens: int) -> tuple[float, float, int]:
    started = time.perf_counter()
    arrivals = []
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith('data: {"id"') and '"content":"' in line and '"content":""' not in line:
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
    http = httpx2.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=600)
    paths = {"hearth chat (NATS)": lambda: over_nats(nc, request),
             "gateway, bare HTTP client": lambda: over_bare_http(http, model, args.max_tokens),
             "gateway, openai client": lambda: over_gateway(client, model, args.max_tokens)}
    results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in paths}
    try:
        for _ in range(args.warmup):
            for run in paths.values():
                await run()
        for round_index in range(args.rounds):
            # Interleaved, and the order alternates, so drift in the machine's load hits all alike.
            order = list(paths.items())
            for name, run in order if round_index % 2 == 0 else reversed(order):
                results[name].append(await run())
        print("| path | rounds | tokens | TTFT median ms | TTFT p90 ms | decode tokens/s median |")
        print("|---|---:|---:|---:|---:|---:|")
        medians = {}
        for name, rows in results.items():
            ttfts, decode = sorted(r[0] for r in rows), [r[1] for r in rows]
            medians[name] = (statistics.median(ttfts), statistics.median(decode))
            print(f"| {name} | {len(rows)} | {rows[0][2]} | {medians[name][0]:.2f} | "
                  f"{ttfts[int(0.9 * (len(ttfts) - 1))]:.2f} | {medians[name][1]:.1f} |")
        chat_ttft, chat_rate = medians["hearth chat (NATS)"]
        for name, (ttft, rate) in list(medians.items())[1:]:
            print(f"\n{name}: {ttft - chat_ttft:+.2f} ms median TTFT, {100.0 * (rate - chat_rate) / chat_rate:+.2f} % "
                  "median decode tokens/s, against hearth chat")
        if args.concurrent:
            served, seconds = await concurrent_clients(client, model, args.concurrent)
            print(f"{args.concurrent} concurrent streaming clients: {served} answered completely in {seconds:.1f} s")
    finally:
        await http.aclose()
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
        cluster.start_even_mesh(model.path, model.num_layers, shards=default_shards)
        api_key = create_api_key(cluster.member_key(MEMBER, "client").parents[1], MEMBER)
        url = cluster.start_gateway().ready_file.read_text()
        run_event_loop(measure(cluster, url, api_key, model.name, args))


if __name__ == "__main__":
    main()
