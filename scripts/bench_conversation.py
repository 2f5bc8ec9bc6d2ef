"""Measures kept prefixes through the OpenAI-compatible gateway: a multi-turn conversation resent whole each turn, and
many members sharing a public system prompt (BENCHMARKS.md, "Conversations: kept prefixes").

For each call it reports the streamed time to first token, the prompt tokens, the prompt positions the hops took from
kept prefixes (`cached_prompt_tokens` of `pipeline.constructed`) and the prompt positions each shard computed (the
delta of its `hearth_shard_prefill_tokens_total`), with the prefix cache on and off (`[prefix_cache] enabled`).

    .venv/bin/python scripts/bench_conversation.py conversation --model random:llama-250m
    .venv/bin/python scripts/bench_conversation.py public --members 50
    python3 scripts/bench_conversation.py conversation --device cuda --dtype bf16   # a GPU's static caches
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import openai
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hearth.events.consume import StoredEvent, read_stream  # noqa: E402
from hearth.events.streams import PIPELINES_STREAM  # noqa: E402
from hearth.services.broker.connection import connect_nats  # noqa: E402
from hearth.services.devtools.local_cluster import LocalCluster, even_layer_ranges  # noqa: E402
from hearth.services.devtools.random_models import RANDOM_PREFIX, random_checkpoint  # noqa: E402
from hearth.services.gateway.keys import create_api_key  # noqa: E402

PREFILL_SAMPLE = "hearth_shard_prefill_tokens_total"
REUSED_SAMPLE = "hearth_shard_prefix_reused_tokens_total"
# Word ids below the random tokenizer's characters and control tokens (hearth/services/devtools/random_models.py).
highest_word_id = 31000
event_wait_s = 30.0


@dataclass
class CallFigures:
    """One call as the client and the mesh saw it."""

    label: str
    ttft_ms: float
    total_ms: float
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = -1
    # The orchestrator's own time to first token (`pipeline.first_token`), without the gateway and HTTP.
    mesh_ttft_ms: float = -1.0
    computed_per_shard: list[int] = field(default_factory=list)
    reused_per_shard: list[int] = field(default_factory=list)


def words(rng: random.Random, count: int) -> str:
    return " ".join(f"t{rng.randrange(1, highest_word_id)}" for _ in range(count))


def model_path(spec: str) -> Path:
    return random_checkpoint(spec) if spec.startswith(RANDOM_PREFIX) else Path(spec)


def shard_counters(cluster: LocalCluster) -> list[tuple[int, int]]:
    """(prompt positions computed, positions reused) of every shard process, in start order."""
    figures = []
    for process in cluster.processes:
        if not process.name.startswith("shard-"):
            continue
        with urllib.request.urlopen(process.metrics_url, timeout=10) as response:
            text = response.read().decode()
        totals = {PREFILL_SAMPLE: 0.0, REUSED_SAMPLE: 0.0}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in totals:
                    totals[sample.name] += sample.value
        figures.append((int(totals[PREFILL_SAMPLE]), int(totals[REUSED_SAMPLE])))
    return figures


class BenchMesh:
    """nats-server, the model's layers over `shards` shard processes, an orchestrator and a gateway, with an API
    key for each member named."""

    def __init__(self, model: Path, shards: int, members: list[str], env: dict[str, str], work_dir: Path | None,
                 device_args: list[str] = (), orchestrators: int = 1):
        self.cluster = LocalCluster(work_dir=work_dir, extra_env=dict(env), prefork=True)
        self.device_args = list(device_args)  # --device/--dtype of the shards and the orchestrator's head
        self.model = model
        self.shards = shards
        self.members = members
        self.orchestrators = orchestrators  # each its own member, as households' orchestrators are
        self.keys: dict[str, str] = {}

    def __enter__(self) -> "BenchMesh":
        cluster = self.cluster
        # Members added before the broker starts: one authorization for all of them instead of a reload each.
        self.keys = {name: create_api_key(cluster.member_key(name, "client").parents[1], name)
                     for name in self.members}
        cluster.start_nats()
        layers = json.loads((self.model / "config.json").read_text())["num_hidden_layers"]
        for index, (lo, hi) in enumerate(even_layer_ranges(layers, self.shards)):
            cluster.start_shard(str(self.model), lo, hi, node_id=f"conv-host-{index}", extra_args=self.device_args,
                                wait_ready=False)
        for index in range(self.orchestrators):
            name = {} if self.orchestrators == 1 else {"node_id": f"conv-orchestrator-{index}"}
            cluster.start_orchestrator(extra_args=["--preload", str(self.model), *self.device_args], wait_ready=False,
                                       **name)
        cluster.wait_all_ready()
        self.url = cluster.start_gateway().ready_file.read_text().strip()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cluster.close()

    def client(self, member: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.keys[member], max_retries=0, timeout=600)

    def call(self, member: str, label: str, *, prompt: str | None = None, messages: list[dict] | None = None,
             max_tokens: int) -> tuple[CallFigures, str]:
        """One streamed greedy call (a raw completion with `prompt`, else a chat with `messages`): its figures
        (cached_prompt_tokens filled in later, from the events) and its text."""
        before = shard_counters(self.cluster)
        client = self.client(member)
        common = dict(model=self.model.name, max_tokens=max_tokens, temperature=0, stream=True,
                      stream_options={"include_usage": True})
        started = time.perf_counter()
        first, pieces, usage = None, [], None
        if prompt is not None:
            stream = client.completions.create(prompt=prompt, **common)
        else:
            stream = client.chat.completions.create(messages=messages, **common)
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if not chunk.choices:
                continue
            piece = chunk.choices[0].text if prompt is not None else (chunk.choices[0].delta.content or "")
            if piece and first is None:
                first = time.perf_counter()
            pieces.append(piece)
        ended = time.perf_counter()
        after = shard_counters(self.cluster)
        figures = CallFigures(label, ttft_ms=1000 * ((first or ended) - started), total_ms=1000 * (ended - started),
                              prompt_tokens=usage.prompt_tokens if usage else -1,
                              completion_tokens=usage.completion_tokens if usage else -1,
                              computed_per_shard=[a[0] - b[0] for a, b in zip(after, before)],
                              reused_per_shard=[a[1] - b[1] for a, b in zip(after, before)])
        return figures, "".join(pieces)

    def fill_cached(self, calls: list[CallFigures]) -> None:
        """cached_prompt_tokens of each call, from the `pipeline.constructed` events (the calls ran one at a time,
        so the last len(calls) of them are theirs, in order)."""
        constructed, first_tokens = asyncio.run(self._constructed_events(len(calls)))
        for figures, event in zip(calls, constructed[-len(calls):]):
            figures.cached_prompt_tokens = event.cached_prompt_tokens
            figures.mesh_ttft_ms = first_tokens.get(event.pipeline_id, -1.0)

    async def _constructed_events(self, at_least: int) -> tuple[list, dict[str, float]]:
        nc = await connect_nats(self.cluster.nats_url, name="bench-conversation",
                                settings=self.cluster.nats_settings())
        try:
            deadline = time.monotonic() + event_wait_s
            while True:
                js = nc.jetstream()
                async with contextlib.aclosing(read_stream(js, PIPELINES_STREAM)) as items:
                    events = [item.event async for item in items if isinstance(item, StoredEvent)]
                constructed = [e for e in events if e.type == "pipeline.constructed"]
                ended = [e for e in events if e.type in ("pipeline.completed", "pipeline.aborted")]
                if (len(constructed) >= at_least and len(ended) >= len(constructed)) or time.monotonic() > deadline:
                    return constructed, {e.pipeline_id: e.ttft_ms for e in events if e.type == "pipeline.first_token"}
                await asyncio.sleep(0.5)
        finally:
            await asyncio.wait_for(nc.close(), timeout=5)


def device_args(options: argparse.Namespace) -> list[str]:
    return [*(["--device", options.device] if options.device else []), *(["--dtype", options.dtype] if options.dtype
                                                                          else [])]


def cache_env(enabled: bool, public_prompt: str | None = None, pins: bool = True) -> dict[str, str]:
    env = {"HEARTH_PREFIX_CACHE__ENABLED": "true" if enabled else "false"}
    if not pins:  # the gateway sends every call to the orchestrators' queue group
        env["HEARTH_GATEWAY__REMEMBERED_CONVERSATIONS"] = "0"
    if public_prompt is not None:
        env["HEARTH_PREFIX_CACHE__PUBLIC_SYSTEM_PROMPTS"] = json.dumps([public_prompt])
    return env


def warm_up(mesh: BenchMesh, member: str, rng: random.Random) -> None:
    """A call that shares no block with the measured ones, so turn 1 does not pay the mesh's first-call costs."""
    mesh.call(member, "warm-up", prompt=words(rng, 100), max_tokens=8)


def conversation(options: argparse.Namespace, mode: str, enabled: bool, pins: bool = True) -> list[list[CallFigures]]:
    """`options.repeats` conversations of `options.turns` turns each, one after the other on one mesh, each
    resending its whole history every turn (the load of a shared machine varies: medians over them); `pins`: the
    gateway sends a conversation's next turn to the orchestrator that answered the last."""
    with BenchMesh(model_path(options.model), options.shards, ["alice"], cache_env(enabled, pins=pins),
                   options.work_dir, device_args(options), options.orchestrators) as mesh:
        warm_up(mesh, "alice", random.Random(options.seed - 1))
        runs = []
        for repeat in range(options.repeats):
            rng = random.Random(options.seed + repeat)  # its own words: no block in common with the others
            calls, history, messages = [], "", []
            for turn in range(1, options.turns + 1):
                if turn > 1:
                    time.sleep(options.think_s)  # the user reading the answer and typing the next turn
                user = words(rng, options.new_words)
                if mode == "completions":
                    history = f"{history} {user}".strip()
                    figures, answer = mesh.call("alice", f"turn {turn}", prompt=history,
                                                max_tokens=options.answer_tokens)
                    history = history + answer
                else:
                    messages.append({"role": "user", "content": user})
                    figures, answer = mesh.call("alice", f"turn {turn}", messages=messages,
                                                max_tokens=options.answer_tokens)
                    messages.append({"role": "assistant", "content": answer})
                calls.append(figures)
                print(f"  {mode} cache {'on' if enabled else 'off'} #{repeat} {figures.label}: ttft "
                      f"{figures.ttft_ms:.0f} ms, prompt {figures.prompt_tokens}, computed "
                      f"{figures.computed_per_shard}", file=sys.stderr, flush=True)
            mesh.fill_cached(calls)
            runs.append(calls)
    return runs


def median_turns(runs: list[list[CallFigures]]) -> list[CallFigures]:
    """Per turn: the median time to first token over the runs, the other figures of the first run."""
    medians = []
    for turn_calls in zip(*runs):
        first = turn_calls[0]
        medians.append(CallFigures(first.label, statistics.median(c.ttft_ms for c in turn_calls),
                                   statistics.median(c.total_ms for c in turn_calls), first.prompt_tokens,
                                   first.completion_tokens, first.cached_prompt_tokens,
                                   statistics.median(c.mesh_ttft_ms for c in turn_calls), first.computed_per_shard,
                                   first.reused_per_shard))
    return medians


def public_prompt_calls(options: argparse.Namespace, public: bool) -> list[CallFigures]:
    """One call per member: the shared system prompt and a user message of the member's own."""
    rng = random.Random(options.seed)
    system = words(rng, options.system_words)
    members = [f"member{index:02d}" for index in range(options.members if public else options.baseline_members)]
    env = cache_env(True, system if public else None)
    with BenchMesh(model_path(options.model), options.shards, members, env, options.work_dir, device_args(options)) as mesh:
        warm_up(mesh, members[0], random.Random(options.seed - 1))
        calls = []
        for member in members:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": words(rng, 60)}]
            figures, _ = mesh.call(member, member, messages=messages, max_tokens=options.answer_tokens)
            calls.append(figures)
            print(f"  public={public} {member}: ttft {figures.ttft_ms:.0f} ms, prompt {figures.prompt_tokens}, "
                  f"computed {figures.computed_per_shard}", file=sys.stderr, flush=True)
        mesh.fill_cached(calls)
    return calls


def table(title: str, calls: list[CallFigures]) -> str:
    lines = [f"{title}", f"{'call':>10s}{'ttft ms':>9s}{'mesh ttft':>10s}{'prompt':>8s}{'cached':>8s}"
                         f"{'computed/shard':>18s}"]
    for c in calls:
        computed = "/".join(str(n) for n in c.computed_per_shard)
        lines.append(f"{c.label:>10s}{c.ttft_ms:9.0f}{c.mesh_ttft_ms:10.0f}{c.prompt_tokens:8d}"
                     f"{c.cached_prompt_tokens:8d}{computed:>18s}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["conversation", "public"])
    parser.add_argument("--model", default="random:llama-250m")
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="conversation: conversations per mesh")
    parser.add_argument("--new-words", type=int, default=60)
    parser.add_argument("--answer-tokens", type=int, default=40)
    parser.add_argument("--think-s", type=float, default=0.0,
                        help="conversation: seconds between an answer and the next turn (a user reading, typing)")
    parser.add_argument("--modes", default="completions,chat", help="conversation: completions and/or chat")
    parser.add_argument("--cache", default="on,off", help="conversation: the prefix cache on and/or off")
    parser.add_argument("--orchestrators", type=int, default=1,
                        help="conversation: orchestrators, each of its own member (kept KV is per member)")
    parser.add_argument("--pins", default="on", help="conversation: the gateway's conversation pins on and/or off")
    parser.add_argument("--members", type=int, default=50, help="public: members sharing the system prompt")
    parser.add_argument("--baseline-members", type=int, default=5,
                        help="public: members calling with the prompt not marked public")
    parser.add_argument("--system-words", type=int, default=500)
    parser.add_argument("--seed", type=int, default=30)
    parser.add_argument("--device", default=None, help="the shards' and the orchestrator's (default: theirs)")
    parser.add_argument("--dtype", default=None, help="the shards' and the orchestrator's (default: theirs)")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write every call's figures here")
    options = parser.parse_args()
    results: dict[str, list[CallFigures]] = {}
    raw: dict[str, list[list[CallFigures]]] = {}
    if options.part == "conversation":
        for mode in options.modes.split(","):
            for state in options.cache.split(","):
                for pins in options.pins.split(","):
                    title = f"{mode}, cache {state}" + (f", pins {pins}" if options.orchestrators > 1 else "")
                    raw[title] = conversation(options, mode, state == "on", pins == "on")
                    results[title + f" (ttft: median of {options.repeats})"] = median_turns(raw[title])
    else:
        results["system prompt public"] = public_prompt_calls(options, True)
        if options.baseline_members:
            results["system prompt not public"] = public_prompt_calls(options, False)
    for title, calls in results.items():
        print(table(title, calls))
        measured = [c for c in calls if c.label.startswith("turn")]
        if measured:
            print(f"turn-{len(measured)} / turn-1 ttft: {measured[-1].ttft_ms / measured[0].ttft_ms:.2f}x")
        elif len(calls) > 1:
            print(f"median computed per shard, calls 2..{len(calls)}: "
                  f"{statistics.median(max(c.computed_per_shard) for c in calls[1:])}")
        print()
    if options.json:
        every = raw or {title: [calls] for title, calls in results.items()}
        options.json.write_text(json.dumps({title: [[asdict(c) for c in calls] for calls in runs]
                                            for title, runs in every.items()}, indent=1))


if __name__ == "__main__":
    main()
