"""Shared pieces of the failover e2e tests: a mesh of real shard processes with replicas, streaming a request
while doing something to a shard at the k-th token, asking shards what they hold, reading events back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient
from prometheus_client.parser import text_string_to_metric_families

from hearth.events.streams import PIPELINES_STREAM, SHARDS_STREAM
from hearth.protocol.subjects import shard_control_subject
from hearth.services.devtools.local_cluster import LocalCluster, ManagedProcess
from hearth.services.client.chat import answer_tokens, stream_chat
from hearth.protocol.chat import ChatParams, ChatRequest
from hearth.protocol.chat_frames import TokenDeltaFrame
from hearth.protocol.control import ControlReply, OpenHop, ShardStat, StatShard
from hearth.services.broker.connection import connect_nats
from hearth.services.orchestrator.hop_owner import open_message, open_signer
from hearth.trust.keys import MemberKey
from tests.e2e.conftest import TINY_MODEL_NAME, start_orchestrator
from tests.e2e.event_log_support import (
    event_wait_timeout_s,
    pipeline_events,
    read_events,
    wait_for_event,
    wait_for_pipeline_end,
)
from tests.unit.inference_tiny_models import TINY_EOS_TOKEN_ID

STEP_TIMEOUT_S = 1.0
HEALTH_TIMEOUT_S = 5.0
HEARTBEAT_S = 0.5
# Re-advertised every ttl/3 = 2 s.
SHARD_TTL_S = 6.0
# The router prefers the lowest hop_weight when queue depths tie: PREFERRED shards are the primaries a test
# breaks, REPLICA shards take over.
PREFERRED_WEIGHT = 0.5
PRIMARY_WEIGHT = 1.0
REPLICA_WEIGHT = 2.0

PROMPT = "the quick brown fox jumps over"
MAX_TOKENS = 24
# The action (kill, freeze, ...) happens when this many tokens have streamed.
ACT_AFTER_TOKENS = 3
# Within the tiny model's context (TINY_CONTEXT_LENGTH) after PROMPT's tokens; seconds of tokens on any machine.
LEAVING_CLIENT_MAX_TOKENS = 960
stat_timeout_s = 2.0
release_timeout_s = 10.0


def failover_env() -> dict[str, str]:
    return {"HEARTH_RESEARCH__DISTRIBUTED_INFERENCE__SHARD_HEALTH_TIMEOUT_S": str(HEALTH_TIMEOUT_S)}


async def open_hop_as_orchestrator(nc, cluster: LocalCluster, control_subject: str, request: OpenHop,
                                   timeout_s: float = 5.0) -> ControlReply:
    """Send `request` to a shard as an orchestrator does: on a community mesh its keys sealed to the host's member key
    and signed with an orchestrator member's key (a shard there refuses an open no member signed, or keys in clear)."""
    key_file = cluster.member_key("test-orchestrator", "orchestrator")
    roster = cluster.community.roster() if cluster.community is not None else None

    def public_key_of(name: str) -> str | None:
        member = roster.by_name(name) if roster is not None else None
        return member.public_key if member is not None else None

    sign = open_signer(MemberKey.load(key_file) if key_file is not None else None, public_key_of)
    host_node = control_subject.split(".")[2]  # hearth.ctl.<node>.<shard_key>
    sent = open_message(request, host_node, control_subject, sign)
    if isinstance(sent, ControlReply):
        return sent
    reply = await nc.request(control_subject, sent[0], timeout=timeout_s, headers=sent[1])
    return ControlReply.model_validate_json(reply.data)


@dataclass
class ShardHandle:
    process: ManagedProcess
    node_id: str
    lo: int
    hi: int
    metrics_port: int | None = None

    @property
    def shard_id(self) -> str:
        return self.process.ready_file.read_text().strip()

    @property
    def control_subject(self) -> str:
        return shard_control_subject(self.node_id, self.shard_id)


@dataclass
class FailoverMesh:
    """A LocalCluster plus the bookkeeping the tests need: shards by node id, the orchestrator, paths."""

    cluster: LocalCluster
    models_dir: Path
    shards: dict[str, ShardHandle] = field(default_factory=dict)
    orchestrator: ManagedProcess | None = None
    orchestrator_db: Path | None = None
    projector_db: Path | None = None
    model_name: str = TINY_MODEL_NAME

    @property
    def model_path(self) -> Path:
        return self.models_dir / self.model_name

    def start_shard(self, node_id: str, lo: int, hi: int, *, hop_weight: float, fault: str | None = None,
                    metrics_port: int | None = None, wait_ready: bool = True,
                    extra_args: list[str] = (), model_path: Path | None = None) -> ShardHandle:
        args = ["--hop-weight", str(hop_weight), "--heartbeat-s", str(HEARTBEAT_S), "--ttl-s", str(SHARD_TTL_S),
                *extra_args]
        if fault:
            args += ["--fault", fault]
        if metrics_port is not None:
            args += ["--metrics-port", str(metrics_port)]
        process = self.cluster.start_shard(str(model_path or self.model_path), lo, hi, node_id=node_id, extra_args=args,
                                           wait_ready=wait_ready)
        handle = self.shards[node_id] = ShardHandle(process, node_id, lo, hi, metrics_port)
        return handle

    def start_orchestrator(self, *, local_model: bool = True, extra_args: list[str] = ()) -> ManagedProcess:
        # A routing read model the tests can look into (WAL: reading never blocks the orchestrator's projector).
        self.orchestrator_db = self.cluster.work_dir / "orchestrator-routing.sqlite"
        args = ["--step-timeout-s", str(STEP_TIMEOUT_S), "--db", str(self.orchestrator_db), *extra_args]
        if local_model:
            args += ["--local-model", self.model_name]
        # Replicas are picked by hop weight after a same-prompt reference call, which kept prefixes would route back.
        kept = {"HEARTH_PREFIX_CACHE__ENABLED": self.cluster.extra_env.get("HEARTH_PREFIX_CACHE__ENABLED", "false")}
        self.orchestrator = start_orchestrator(self.cluster, self.models_dir, extra_args=args, env=kept,
                                               model_name=self.model_name)
        return self.orchestrator

    def stop_shard(self, handle: ShardHandle) -> None:
        handle.process.stop()
        self.shards.pop(handle.node_id, None)

    def live_shards(self) -> list[ShardHandle]:
        return [handle for handle in self.shards.values() if handle.process.alive]

    def routing_row(self, table: str, shard_id: str) -> dict | None:
        """A row of the orchestrator's own read model (`shards`, `shard_health`, `shard_stats`)."""
        if self.orchestrator_db is None or not self.orchestrator_db.exists():
            return None
        with contextlib.closing(sqlite3.connect(f"file:{self.orchestrator_db}?mode=ro", uri=True, timeout=5)) as db:
            db.row_factory = sqlite3.Row
            try:
                row = db.execute(f"SELECT * FROM {table} WHERE shard_id = ?", (shard_id,)).fetchone()
            except sqlite3.OperationalError:  # not migrated yet
                return None
        return dict(row) if row is not None else None

    async def wait_routing(self, table: str, shard_id: str, predicate: Callable[[dict], bool],
                           timeout_s: float = event_wait_timeout_s) -> dict:
        """Wait until the orchestrator's read model has a row for the shard that satisfies `predicate`."""
        deadline = time.monotonic() + timeout_s
        while True:
            row = self.routing_row(table, shard_id)
            if row is not None and predicate(row):
                return row
            if time.monotonic() > deadline:
                raise AssertionError(f"{table} row of {shard_id} is still {row} after {timeout_s} s")
            await asyncio.sleep(0.05)

    def serve(self, shards: list[tuple[str, int, int, float]], *, local_model: bool = False) -> "FailoverMesh":
        """Start `shards` ((node, lo, hi, hop weight) each) and an orchestrator routing with them all."""
        for node_id, lo, hi, weight in shards:
            self.start_shard(node_id, lo, hi, hop_weight=weight, wait_ready=False)
        self.start_orchestrator(local_model=local_model)
        self.cluster.wait_all_ready()
        self.wait_all_advertised()
        return self

    @contextlib.asynccontextmanager
    async def extra_shards(self):
        """start(node_id, lo, hi, hop_weight, fault=None): a shard started and advertised, stopped on leaving."""
        started: list[ShardHandle] = []

        async def start(node_id: str, lo: int, hi: int, hop_weight: float, fault: str | None = None) -> ShardHandle:
            handle = await asyncio.to_thread(self.start_shard, node_id, lo, hi, hop_weight=hop_weight, fault=fault)
            started.append(handle)
            await self.wait_advertised(handle)
            return handle

        try:
            yield start
        finally:
            for handle in started:
                await asyncio.to_thread(self.stop_shard, handle)

    def wait_all_advertised(self, timeout_s: float = event_wait_timeout_s) -> None:
        """Block until the orchestrator routes with every started shard (for module fixtures, before any call)."""
        deadline = time.monotonic() + timeout_s
        for handle in self.shards.values():
            while (row := self.routing_row("shards", handle.shard_id)) is None or row["status"] != "advertised":
                if time.monotonic() > deadline:
                    raise AssertionError(f"the orchestrator does not know {handle.shard_id} after {timeout_s} s")
                time.sleep(0.05)

    async def wait_idle_in_routing(self, handle: ShardHandle) -> None:
        """The orchestrator's read model shows the shard idle. Routing prefers the lowest queue depth before
        hop_weight, and a heartbeat sampled while the shard computed a step of an earlier test reports 1 until
        the next heartbeat (every HEARTBEAT_S): a test that needs this shard routed to waits for it."""
        await self.wait_routing("shard_health", handle.shard_id,
                                lambda row: row["queue_depth"] == 0 and row["active_streams"] == 0)

    async def wait_advertised(self, handle: ShardHandle) -> None:
        """The orchestrator routes with this shard's (latest) advertisement."""
        await self.wait_routing("shards", handle.shard_id, lambda row: row["status"] == "advertised")


@contextlib.contextmanager
def failover_mesh(tmp_path_factory, models_dir: Path, name: str, extra_env: dict[str, str] | None = None,
                  model_name: str = TINY_MODEL_NAME) -> Iterator[FailoverMesh]:
    work_dir = tmp_path_factory.mktemp(name)
    env = {**failover_env(), **(extra_env or {})}
    with LocalCluster(work_dir=work_dir / "cluster", torch_threads=1, extra_env=env) as cluster:
        cluster.start_nats()
        mesh = FailoverMesh(cluster, models_dir, model_name=model_name)
        try:
            yield mesh
        finally:
            for process in cluster.processes:
                print(f"----- {process.name} -----\n{process.log_tail(6000)}")


def chat_request(*, fallback_to_local: bool = False, max_tokens: int = MAX_TOKENS) -> ChatRequest:
    return ChatRequest(model=TINY_MODEL_NAME, prompt=PROMPT, max_tokens=max_tokens, temperature=0.0,
                       params=ChatParams(fallback_to_local=fallback_to_local))


def leaving_client_request() -> ChatRequest:
    """A call whose client leaves after a few tokens: its answer must outlast the orchestrator's
    `client_missing_grace_s` on the fastest machine, or the call completes before the leave is noticed. The tiny
    model's greedy answer to PROMPT ends by itself after about 250 tokens, so its end-of-text token is barred."""
    return ChatRequest(model=TINY_MODEL_NAME, prompt=PROMPT, max_tokens=LEAVING_CLIENT_MAX_TOKENS, temperature=0.0,
                       logit_bias={TINY_EOS_TOKEN_ID: -100.0}, params=ChatParams(fallback_to_local=False))


@dataclass
class StreamedCall:
    """Every frame of one call, with the monotonic instant each arrived and when the action ran."""

    frames: list = field(default_factory=list)
    arrived_at: list[float] = field(default_factory=list)
    acted_at: float | None = None

    def of_type(self, frame_type: str) -> list:
        return [f for f in self.frames if f.type == frame_type]

    @property
    def token_ids(self) -> list[int]:
        return [f.token_id for f in self.frames if isinstance(f, TokenDeltaFrame)]

    @property
    def final(self):
        return self.frames[-1] if self.frames else None

    @property
    def pipeline_id(self) -> str:
        return self.of_type("pipeline")[0].pipeline_id

    @property
    def first_hops(self) -> list[str]:
        return self.of_type("pipeline")[0].hops

    @property
    def hops(self) -> list[str]:
        """Every shard the call ran on: its first chain's and each failover's."""
        return [*self.first_hops, *(hop for frame in self.of_type("shard_failover") for hop in frame.replacement_hops)]

    @property
    def answer_token_ids(self) -> list[int]:
        """The answer's tokens as a client keeps them (withdrawn ones dropped)."""
        return answer_tokens(self.frames).token_ids

    def longest_token_gap_s(self) -> float:
        """The longest wait between two consecutive token_delta frames: the pause a failover costs."""
        times = [t for f, t in zip(self.frames, self.arrived_at) if isinstance(f, TokenDeltaFrame)]
        return max((b - a for a, b in zip(times, times[1:])), default=0.0)

    def seconds_from_action_to_end(self) -> float:
        return self.arrived_at[-1] - self.acted_at


Action = Callable[[], Awaitable[None] | None]


async def stream_with_action(
    nc: NatsClient,
    request: ChatRequest,
    action: Action | None = None,
    *,
    after_tokens: int = ACT_AFTER_TOKENS,
    more_actions: dict[int, Action] | None = None,
    first_frame_timeout: float = 60.0,
    frame_gap_timeout: float = 30.0,
) -> StreamedCall:
    """Stream one call; right after the `after_tokens`-th token_delta arrives, run `action` (once), and after
    the n-th token each of `more_actions[n]`. `acted_at` is when the first action ran."""
    actions = dict(more_actions or {})
    if action is not None:
        actions[after_tokens] = action
    call = StreamedCall()
    tokens = 0
    async for frame in stream_chat(nc, request, first_frame_timeout=first_frame_timeout,
                                   frame_gap_timeout=frame_gap_timeout):
        call.frames.append(frame)
        call.arrived_at.append(time.monotonic())
        if isinstance(frame, TokenDeltaFrame):
            tokens += 1
            if tokens in actions:
                if call.acted_at is None:
                    call.acted_at = time.monotonic()
                result = actions.pop(tokens)()
                if result is not None:
                    await result
    return call


async def shard_stat(nc: NatsClient, handle: ShardHandle, timeout_s: float = stat_timeout_s) -> ShardStat:
    message = await nc.request(handle.control_subject, StatShard().model_dump_json().encode(), timeout=timeout_s)
    return ShardStat.model_validate_json(message.data)


async def wait_until_released(nc: NatsClient, handles: list[ShardHandle],
                              timeout_s: float = release_timeout_s) -> dict[str, ShardStat]:
    """Poll `stat` until no shard holds an open hop or a cached session; the last answers otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = {handle.node_id: await shard_stat(nc, handle) for handle in handles}
        if all(s.active_streams == 0 and s.cached_sessions == 0 for s in stats.values()) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


def scrape_metric(port: int, name: str, labels: dict[str, str]) -> float:
    """One sample from a process's /metrics (0.0 when absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def replay_pipeline(cluster: LocalCluster, pipeline_id: str) -> list[dict]:
    """`hearth-replay pipeline ID --output jsonl` (as the cluster's system user), parsed."""
    command = [sys.executable, "-m", "hearth.services.replay.cli", "pipeline", pipeline_id, "--output", "jsonl",
               "--nats", cluster.nats_url]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=str(
        Path(__file__).resolve().parents[2]), env={**os.environ, **cluster.credentials_env(cluster.system_creds)})
    assert completed.returncode == 0, completed.stderr
    return [json.loads(line) for line in completed.stdout.splitlines() if line.strip()]


__all__ = [
    "ACT_AFTER_TOKENS", "HEALTH_TIMEOUT_S", "MAX_TOKENS", "PIPELINES_STREAM", "PREFERRED_WEIGHT", "PRIMARY_WEIGHT",
    "REPLICA_WEIGHT", "SHARDS_STREAM", "STEP_TIMEOUT_S", "FailoverMesh", "ShardHandle", "StreamedCall",
    "chat_request", "failover_mesh", "leaving_client_request", "pipeline_events", "read_events", "replay_pipeline",
    "scrape_metric", "shard_stat",
    "stream_with_action", "wait_for_event", "wait_for_pipeline_end", "wait_until_released",
]


def run_reference_call(cluster: LocalCluster):
    """One uninterrupted greedy call of chat_request(): what every failed-over run must reproduce."""

    async def run():
        client = await connect_nats(cluster.nats_url, name="failover-reference", settings=cluster.nats_settings())
        try:
            return await stream_with_action(client, chat_request())
        finally:
            await client.close()

    return asyncio.run(run())


@pytest.fixture
async def nc(mesh):
    """A client connection to the module's mesh (`mesh` is each test module's own fixture)."""
    client = await connect_nats(mesh.cluster.nats_url, name="failover-test", settings=mesh.cluster.nats_settings())
    try:
        yield client
    finally:
        await asyncio.wait_for(client.close(), timeout=5)
