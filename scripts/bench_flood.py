"""How long another member's call waits to start while one member floods the mesh: the time from sending a
short call to its `pipeline` frame (started) and to its first token, measured for a few calls alone and then
while a flooder keeps many long-prompt calls outstanding (re-sending each as it ends, and at once after an
`overloaded` answer, as an attacker would), on a secure community mesh of real processes (3 shard hosts, an
orchestrator with its default admission settings, as `hearth demo` runs it). The flooder runs in a process of
its own, so that its client's work does not slow the neighbour's measurement. Prints JSON.

    .venv/bin/python scripts/bench_flood.py --calls 5 --flood 64
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoTokenizer  # noqa: E402

from hearth.services.devtools.local_cluster import LocalCluster  # noqa: E402
from hearth.services.client.chat import stream_chat  # noqa: E402
from hearth.protocol.chat import ChatMessage, ChatParams, ChatRequest  # noqa: E402
from hearth.protocol.chat_frames import ErrorFrame  # noqa: E402
from hearth.services.common.config import HearthSettings, NatsSettings  # noqa: E402
from hearth.services.common.lifecycle import run_event_loop  # noqa: E402
from hearth.services.broker.connection import connect_nats  # noqa: E402
from hearth.services.devtools.demo import DemoModel, default_shards, resolve_demo_model  # noqa: E402

FLOODER = "bench-flooder"
NEIGHBOUR = "bench-neighbour"
NEIGHBOUR_PROMPT = "Tell me a fortune."
FLOOD_WORDS = "hearth runs one model across the machines of a community mesh".split()
# An attacker ignores retry_after_s; this short pause only keeps the flooder's own loop from spinning.
OVERLOADED_PAUSE_S = 0.01


def long_prompt(model_path: Path, tokens: int) -> str:
    """A prompt of about `tokens` tokens of the model's tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    text = " ".join(FLOOD_WORDS[i % len(FLOOD_WORDS)] for i in range(tokens * 2))
    return tokenizer.decode(tokenizer(text)["input_ids"][:tokens], skip_special_tokens=True)


def fresh(request: ChatRequest) -> ChatRequest:
    return request.model_copy(update={"request_id": f"b{time.monotonic_ns()}"})


async def flood_worker(nc, request: ChatRequest, stop: asyncio.Event, outcomes: collections.Counter) -> None:
    while not stop.is_set():
        final = None
        async for frame in stream_chat(nc, fresh(request), first_frame_timeout=600, frame_gap_timeout=600):
            final = frame
        outcome = final.code if isinstance(final, ErrorFrame) else final.type
        outcomes[outcome] += 1
        if outcome == "overloaded":
            await asyncio.sleep(OVERLOADED_PAUSE_S)


def flood_process(settings: NatsSettings, request_json: str, workers: int, stop, outcomes_out) -> None:
    """The flooder (a child process): `workers` calls outstanding until `stop` is set, then its outcomes."""

    async def flood() -> dict:
        nc = await connect_nats(settings.url, name="bench-flooder", settings=settings)
        request = ChatRequest.model_validate_json(request_json)
        done = asyncio.Event()
        outcomes: collections.Counter = collections.Counter()
        tasks = [asyncio.create_task(flood_worker(nc, request, done, outcomes)) for _ in range(workers)]
        while not stop.is_set():
            await asyncio.sleep(0.1)
        done.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await nc.close()
        return dict(outcomes)

    outcomes_out.put(run_event_loop(flood()))


async def timed_call(nc, request: ChatRequest) -> dict:
    """Seconds from sending to the call's `pipeline` frame and to its first token, its `queued` frames, and
    how it ended."""
    sent = time.perf_counter()
    started_s = first_token_s = None
    queued = 0
    final = None
    async for frame in stream_chat(nc, fresh(request), first_frame_timeout=600, frame_gap_timeout=600):
        now = time.perf_counter() - sent
        if frame.type == "queued":
            queued += 1
        elif frame.type == "pipeline" and started_s is None:
            started_s = now
        elif frame.type == "token_delta" and first_token_s is None:
            first_token_s = now
        final = frame
    ended = final.code if isinstance(final, ErrorFrame) else final.type
    return {"started_s": started_s, "first_token_s": first_token_s, "queued_frames": queued, "ended": ended}


def summary(calls: list[dict]) -> dict:
    out: dict = {"calls": len(calls), "ended": dict(collections.Counter(c["ended"] for c in calls))}
    for key in ("started_s", "first_token_s"):
        values = [c[key] for c in calls if c[key] is not None]
        out[key] = ({"median": round(statistics.median(values), 4), "max": round(max(values), 4)}
                    if values else None)
    out["per_call"] = calls
    return out


async def measure(cluster: LocalCluster, model: DemoModel, prompt: str, args) -> dict:
    flooder_settings = cluster.nats_settings(cluster.member_key(FLOODER, "client"))
    neighbour = await connect_nats(cluster.nats_url, name="bench-neighbour",
                                   settings=cluster.nats_settings(cluster.member_key(NEIGHBOUR, "client")))
    params = ChatParams(fallback_to_local=False)
    # As `hearth chat` asks (the chat template when the model has one), so that it answers with text.
    asked = ({"messages": [ChatMessage(role="user", content=NEIGHBOUR_PROMPT)]} if model.has_chat_template
             else {"prompt": NEIGHBOUR_PROMPT})
    short = ChatRequest(model=model.name, max_tokens=args.max_tokens, temperature=0.0, params=params, **asked)
    heavy = ChatRequest(model=model.name, prompt=prompt, max_tokens=args.flood_max_tokens, temperature=0.0,
                        params=params)
    try:
        await timed_call(neighbour, short)  # warm-up: loads and routes once
        alone = [await timed_call(neighbour, short) for _ in range(args.calls)]
        spawn = multiprocessing.get_context("spawn")
        stop, outcomes_out = spawn.Event(), spawn.Queue()
        flooder = spawn.Process(target=flood_process, name="bench-flooder",
                                args=(flooder_settings, heavy.model_dump_json(), args.flood, stop, outcomes_out))
        flooder.start()
        try:
            await asyncio.sleep(args.flood_warmup_s)
            flooded = []
            for _ in range(args.calls):
                flooded.append(await timed_call(neighbour, short))
                await asyncio.sleep(args.gap_s)
        finally:
            stop.set()
            outcomes = await asyncio.to_thread(outcomes_out.get, timeout=60)
            await asyncio.to_thread(flooder.join, 10)
        return {"alone": summary(alone), "while_flooded": summary(flooded), "flood_outcomes": outcomes}
    finally:
        await neighbour.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="as `hearth demo --model` (default: the bundled model)")
    parser.add_argument("--calls", type=int, default=5, help="the neighbour's calls, alone and then while flooded")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens of each of the neighbour's calls")
    parser.add_argument("--flood", type=int, default=64, help="calls the flooder keeps outstanding")
    parser.add_argument("--flood-prompt-tokens", type=int, default=256)
    parser.add_argument("--flood-max-tokens", type=int, default=64)
    parser.add_argument("--flood-warmup-s", type=float, default=5.0, help="flooding before the first measured call")
    parser.add_argument("--gap-s", type=float, default=1.0, help="between the neighbour's calls while flooded")
    args = parser.parse_args()
    model = resolve_demo_model(args.model)
    prompt = long_prompt(model.path, args.flood_prompt_tokens)
    with LocalCluster(torch_threads=1) as cluster:
        cluster.start_nats()
        cluster.start_even_mesh(model.path, model.num_layers, shards=default_shards)
        result = run_event_loop(measure(cluster, model, prompt, args))
    limits = HearthSettings().orchestrator
    print(json.dumps({"model": args.model or model.path.name, "args": vars(args),
                      "settings": {"max_concurrent_pipelines":
                                   HearthSettings().research.distributed_inference.max_concurrent_pipelines,
                                   "max_streams_per_caller": limits.max_streams_per_caller,
                                   "max_queued_requests": limits.max_queued_requests,
                                   # getattr: the same script also measures code from before the setting existed.
                                   "max_queued_per_caller": getattr(limits, "max_queued_per_caller", None)},
                      **result}, indent=2))


if __name__ == "__main__":
    main()
