"""A leak soak: rounds of mixed calls on a small mesh of real processes (nats-server with monitoring, three shard
hosts of random:tiny, an orchestrator, a projector, a gateway), each process measured at idle before, between and
after the rounds: RSS, open file descriptors, threads, NATS subscriptions and consumers, the read model's rows and
file size, the streams' sizes. Something that grows with every round and does not come back at idle is a leak.

The calls of a round: short and long prompts over NATS, streamed and whole over the gateway, calls the client
cancels mid-stream (NATS and HTTP), calls past the orchestrator's deadline, bad requests (HTTP and NATS), two
members' multi-turn conversations (kept prefixes), two choices at once. Everything it starts is stopped.

--census counts each hearth process's Python objects, asyncio tasks and the sizes of hearth's and nats-py's
containers (instance attributes and module globals) after a full collection, by running a few lines inside it
through gdb (needs gdb and ptrace rights, e.g. root). The report (--out) holds every measurement, the outcomes of
the calls and `growth`: per process, what changed from the end of the first round to the end of the last.

Usage: .venv/bin/python scripts/soak_leaks.py [--rounds 4] [--calls-per-kind 6] [--idle-s 8] [--census] [--keep]
       [--out soak-leaks.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from hearth.protocol.chat import ChatMessage, ChatRequest  # noqa: E402
from hearth.services.broker.connection import connect_nats  # noqa: E402
from hearth.services.client.chat import chat, stream_chat, stream_chat_raw  # noqa: E402
from hearth.services.devtools.local_cluster import LocalCluster, even_layer_ranges  # noqa: E402
from hearth.services.devtools.random_models import random_checkpoint  # noqa: E402
from hearth.services.gateway.keys import create_api_key  # noqa: E402
from soak_leaks_measures import growth, heap_census, snapshot, start_monitored_nats  # noqa: E402

MODEL_SPEC = "random:tiny"
MODEL_LAYERS = 6
SHORT_PROMPT = "t1 t2 t3 t4"
LONG_PROMPT = " ".join(f"t{index % 400 + 1}" for index in range(900))
DEADLINE_S = 3.0
CALL_TIMEOUT_S = 60.0


class Load:
    """One round's calls of every kind; counts their outcomes."""

    def __init__(self, cluster: LocalCluster, gateway_url: str, keys: dict[str, str], model: str,
                 gateway_model: str) -> None:
        self.cluster, self.url, self.keys, self.model = cluster, gateway_url, keys, model
        self.gateway_model = gateway_model
        self.outcomes: dict[str, int] = {}

    def count(self, kind: str, outcome: str) -> None:
        key = f"{kind}:{outcome}"
        self.outcomes[key] = self.outcomes.get(key, 0) + 1

    async def nats_call(self, nc, kind: str, **fields) -> None:
        result = await chat(nc, ChatRequest(model=self.model, **fields))
        last = result.frames[-1] if result.frames else None
        self.count(kind, getattr(last, "type", "none") if getattr(last, "type", "") == "done"
                   else getattr(last, "code", getattr(last, "type", "none")))

    async def nats_cancelled(self, nc) -> None:
        request = ChatRequest(model=self.model, prompt=SHORT_PROMPT, max_tokens=400)
        frames = 0
        async with contextlib.aclosing(stream_chat(nc, request)) as stream:
            async for _ in stream:
                frames += 1
                if frames >= 3:
                    break
        self.count("nats_cancelled", "left")

    async def nats_timed_out(self, nc) -> None:
        request = ChatRequest(model=self.model, prompt=SHORT_PROMPT, max_tokens=400)
        try:
            async with asyncio.timeout(0.4):
                async for _ in stream_chat(nc, request):
                    pass
            self.count("nats_timed_out", "finished")
        except TimeoutError:
            self.count("nats_timed_out", "timed_out")

    async def fresh_connection(self) -> None:
        """A call on a connection of its own, as `hearth chat` makes one."""
        nc = await connect_nats(self.cluster.nats_url, name="soak-cli", settings=self.cluster.nats_settings())
        try:
            await self.nats_call(nc, "fresh_connection", prompt=SHORT_PROMPT, max_tokens=4, logprobs=True,
                                 top_logprobs=2, stop=["t7"])
        finally:
            await nc.close()

    async def http_structured(self, http: httpx.AsyncClient, index: int) -> None:
        schema = {"type": "object", "properties": {f"k{index}": {"type": "integer"}}, "required": [f"k{index}"]}
        await self.http_whole(http, "eve", [{"role": "user", "content": "t3"}], max_tokens=16, response_format={
            "type": "json_schema", "json_schema": {"name": f"s{index}", "schema": schema}})

    async def http_hang_up(self) -> None:
        """A client that sends a whole request and closes its socket before any answer."""
        host, _, port = self.url.removeprefix("http://").partition(":")
        body = json.dumps({"model": self.gateway_model, "max_tokens": 50,
                           "messages": [{"role": "user", "content": SHORT_PROMPT}]}).encode()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {self.keys['bob']}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                     + body)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()
        self.count("http_hang_up", "closed")

    async def nats_bad(self, nc) -> None:
        for payload in (b"not json", b'{"prompt": ""}', json.dumps({"model": self.model, "prompt": "x",
                                                                    "max_tokens": -3}).encode()):
            frames = [frame async for frame in stream_chat_raw(nc, payload)]
            self.count("nats_bad", getattr(frames[-1], "code", "none") if frames else "none")

    def headers(self, member: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[member]}"}

    async def http_whole(self, http: httpx.AsyncClient, member: str, messages: list[dict], **extra) -> str:
        response = await http.post(f"{self.url}/v1/chat/completions", headers=self.headers(member),
                                   json={"model": self.gateway_model, "messages": messages, "max_tokens": 8, **extra})
        self.count("http_whole", str(response.status_code))
        return response.json()["choices"][0]["message"]["content"] if response.status_code == 200 else ""

    async def http_stream(self, http: httpx.AsyncClient, member: str, leave_after: int | None) -> None:
        body = {"model": self.gateway_model, "messages": [{"role": "user", "content": SHORT_PROMPT}], "stream": True,
                "max_tokens": 200 if leave_after else 12}
        async with http.stream("POST", f"{self.url}/v1/chat/completions", headers=self.headers(member),
                               json=body) as response:
            chunks = 0
            async for _ in response.aiter_lines():
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    break
        self.count("http_stream_left" if leave_after else "http_stream", str(response.status_code))

    async def http_bad(self, http: httpx.AsyncClient) -> None:
        url = f"{self.url}/v1/chat/completions"
        attempts = [
            http.post(url, headers=self.headers("eve"), content=b"{not json"),
            http.post(url, headers={"Authorization": "Bearer wrong"}, json={"model": self.gateway_model}),
            http.post(url, headers=self.headers("eve"), json={"model": self.gateway_model, "max_tokens": 10 ** 9,
                                                                "messages": [{"role": "user", "content": "x"}]}),
            http.post(url, headers=self.headers("eve"), json={"model": "no-such-model",
                                                                "messages": [{"role": "user", "content": "x"}]}),
        ]
        for response in await asyncio.gather(*attempts):
            self.count("http_bad", str(response.status_code))

    async def conversation(self, http: httpx.AsyncClient, member: str, turns: int) -> None:
        messages = [{"role": "system", "content": "t5 t6 t7"}]
        for turn in range(turns):
            messages.append({"role": "user", "content": f"t{turn + 10} t{turn + 11} t{turn + 12}"})
            answer = await self.http_whole(http, member, messages)
            messages.append({"role": "assistant", "content": answer})

    async def round(self, calls_per_kind: int) -> None:
        nc = await connect_nats(self.cluster.nats_url, name="soak-client", settings=self.cluster.nats_settings())
        try:
            async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S) as http:
                for index in range(calls_per_kind):
                    member = ("alice", "bob")[index % 2]
                    async with asyncio.timeout(CALL_TIMEOUT_S * 4):
                        await asyncio.gather(
                            self.nats_call(nc, "short", prompt=SHORT_PROMPT, max_tokens=8),
                            self.nats_call(nc, "long", prompt=LONG_PROMPT, max_tokens=4),
                            self.nats_call(nc, "two_choices", messages=[ChatMessage(role="user", content="t9")],
                                           max_tokens=6, n=2, temperature=0.7, seed=index),
                            self.nats_call(nc, "past_deadline", prompt=SHORT_PROMPT, max_tokens=3000),
                            self.nats_cancelled(nc), self.nats_timed_out(nc), self.nats_bad(nc),
                            self.http_stream(http, member, None), self.http_stream(http, member, 3),
                            self.http_bad(http), self.conversation(http, member, 3), self.fresh_connection(),
                            self.http_structured(http, index), self.http_hang_up())
        finally:
            await nc.close()


def run(options: argparse.Namespace) -> dict:
    model = random_checkpoint(MODEL_SPEC)
    work = Path(tempfile.mkdtemp(prefix="hearth-soak-leaks-"))
    report: dict = {"rounds": options.rounds, "calls_per_kind": options.calls_per_kind, "snapshots": []}
    env = {"HEARTH_ORCHESTRATOR__REQUEST_DEADLINE_S": str(DEADLINE_S),
           "HEARTH_SHARD__PREFIX_CACHE_IDLE_S": str(options.idle_s / 2)}
    with LocalCluster(work_dir=work / "cluster", torch_threads=1, extra_env=env, prefork=True) as cluster:
        nats = start_monitored_nats(cluster)
        for index, (lo, hi) in enumerate(even_layer_ranges(MODEL_LAYERS, 3)):
            cluster.start_shard(str(model), lo, hi, node_id=f"host{index}", wait_ready=False)
        cluster.start_orchestrator(extra_args=["--preload", str(model)], wait_ready=False)
        db_path = work / "readmodel.sqlite"
        cluster.start_projector(db_path, wait_ready=False)
        cluster.wait_all_ready()
        keys = {name: create_api_key(cluster.member_key(name, "client").parents[1], name) for name in ("alice", "bob", "eve")}
        gateway = cluster.start_gateway()
        gateway_url = gateway.ready_file.read_text().strip()
        listed = httpx.get(f"{gateway_url}/v1/models", headers={"Authorization": f"Bearer {keys['alice']}"}).json()
        load = Load(cluster, gateway_url, keys, str(model), listed["data"][0]["id"])

        def measure(label: str) -> None:
            time.sleep(options.idle_s)
            shot = snapshot(cluster, nats, db_path)
            shot["label"] = label
            if options.census:
                shot["census"] = {process.name: heap_census(process.popen.pid, work, label)
                                  for process in cluster.processes if process.alive}
            report["snapshots"].append(shot)
            options.out.write_text(json.dumps(report, indent=1))  # an interrupted soak keeps what it measured
            print(f"soak-leaks: {label}: " + ", ".join(
                f"{name} rss {numbers['VmRSS'] // 1024} MiB fds {numbers['fds']} threads {numbers['Threads']}"
                for name, numbers in shot["processes"].items()) + f"; subs {shot['total_subscriptions']}", flush=True)

        measure("started")
        asyncio.run(load.round(1))  # warm-up: first calls allocate what every later one reuses
        measure("warm")
        for index in range(options.rounds):
            began = time.monotonic()
            asyncio.run(load.round(options.calls_per_kind))
            print(f"soak-leaks: round {index + 1} took {time.monotonic() - began:.1f} s", flush=True)
            measure(f"after round {index + 1}")
        report["outcomes"] = load.outcomes
        report["logs"] = {process.name: process.log_tail(2000) for process in cluster.processes}
    if not options.keep:
        shutil.rmtree(work, ignore_errors=True)
    report["growth"] = growth(report)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds of calls after the warm-up round")
    parser.add_argument("--calls-per-kind", type=int, default=6, help="calls of each kind in a round")
    parser.add_argument("--idle-s", type=float, default=8.0, help="idle wait before each measurement")
    parser.add_argument("--census", action="store_true",
                        help="also count each hearth process's objects, tasks and containers (through gdb)")
    parser.add_argument("--keep", action="store_true", help="keep the mesh's folder (logs, stores, read model)")
    parser.add_argument("--out", type=Path, default=Path("soak-leaks.json"), help="where the report is written")
    options = parser.parse_args()
    if options.rounds < 1 or options.calls_per_kind < 1 or options.idle_s < 0:
        parser.error("--rounds and --calls-per-kind must be at least 1, --idle-s at least 0")
    report = run(options)
    options.out.write_text(json.dumps(report, indent=1))
    print(f"soak-leaks: {sum(report['outcomes'].values())} calls {report['outcomes']}")
    for name, change in report["growth"].items():
        print(f"soak-leaks: {name} from round 1's end to the last: {change}")
    print(f"soak-leaks: report {options.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
