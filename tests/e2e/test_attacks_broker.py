"""Attacks on a secure mesh through the broker, as a malicious member of each role would make them: JetStream
administration (only the steward may create, update, delete, purge a stream, delete or snapshot its messages, or
read a stream its role may not), and requests whose reply subject is not a caller's inbox (the orchestrator
would answer with its own rights: into the event log, another member's inbox, JetStream's API). Each is refused
(the broker drops it; the orchestrator sends nothing and counts it), and the event log verifies afterwards."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import nats
import pytest

from hearth.events.streams import ALL_STREAMS, PIPELINES_STREAM, SHARDS_STREAM
from hearth.services.devtools.local_cluster import LocalCluster
from hearth.services.common.call_signing import signed_call_headers
from hearth.protocol.chat import ChatRequest
from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT, MODELS_REQUEST_SUBJECT
from hearth.services.broker.connection import connect_nats, flush_ordered
from tests.e2e.conftest import TINY_MODEL_NAME, three_shard_mesh
from hearth.trust.keys import MemberKey

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
ROLES = ("shard", "orchestrator", "projector", "auditor", "client")
READABLE = {"shard": (SHARDS_STREAM,), "orchestrator": ALL_STREAMS, "projector": ALL_STREAMS,
            "auditor": ALL_STREAMS, "client": ()}
ADMIN_VERBS = ("STREAM.CREATE.{s}", "STREAM.UPDATE.{s}", "STREAM.DELETE.{s}", "STREAM.PURGE.{s}",
               "STREAM.MSG.DELETE.{s}", "STREAM.SNAPSHOT.{s}", "STREAM.RESTORE.{s}",
               "CONSUMER.DURABLE.CREATE.{s}.attack", "CONSUMER.CREATE.{s}")
UNREADABLE_VERBS = ("STREAM.INFO.{s}", "CONSUMER.CREATE.{s}.attack", "CONSUMER.CREATE.{s}.attack.hearth.>",
                    "STREAM.MSG.GET.{s}", "DIRECT.GET.{s}")
# Long enough for the broker to deliver what it let through to a subscriber on the same machine.
DELIVERY_WAIT_S = 3.0
REPLAY_TIMEOUT_S = 120
REQUEST = ChatRequest(model=TINY_MODEL_NAME, prompt="the lazy dog", max_tokens=3)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    with three_shard_mesh(tmp_path_factory.mktemp("attacks-broker"), tiny_models_dir) as cluster:
        for role in ROLES:
            cluster.member_key(f"evil-{role}", role)
        yield cluster


async def connect_as(mesh: LocalCluster, name: str):
    """A raw connection as member `name` that ignores the broker's permission errors (it is attacking)."""
    async def ignore(_error: Exception) -> None:
        return None

    seed = mesh.member_key(name, _role_of(name)).read_text()
    return await nats.connect(mesh.nats_url, nkeys_seed_str=seed, inbox_prefix=f"_INBOX.{name}",
                              error_cb=ignore, allow_reconnect=False, connect_timeout=5)


def _role_of(name: str) -> str:
    return name.removeprefix("evil-")


class Watcher:
    """The steward's connection, subscribed to subjects an attack aims at, recording what reaches them: with
    `from_attackers`, only requests whose reply is an attacker's inbox; else only answers (a frame's JSON, with its
    `type`, or a models list), not the mesh's own JetStream traffic on the same subjects."""

    def __init__(self, nc) -> None:
        self.nc, self.seen = nc, []

    async def watch(self, *subjects: str, from_attackers: bool = False) -> None:
        async def record(msg) -> None:
            if from_attackers:
                attack = (msg.reply or "").startswith("_INBOX.evil-")
            else:
                attack = any(key in msg.data for key in (b'"type"', b'"models"'))
            if attack:
                self.seen.append(msg.subject)

        for subject in subjects:
            await self.nc.subscribe(subject, cb=record)
        await flush_ordered(self.nc, DELIVERY_WAIT_S)


async def watcher(mesh: LocalCluster) -> Watcher:
    return Watcher(await connect_nats(mesh.nats_url, name="steward-watcher", settings=mesh.nats_settings()))


def foreign_replies_refused(mesh: LocalCluster) -> float:
    url = next(url for name, url in mesh.metrics_urls().items() if name.startswith("orchestrator"))
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    line = next((line for line in text.splitlines()
                 if line.startswith('hearth_calls_refused_total{reason="foreign_reply"}')), None)
    return float(line.split()[-1]) if line else 0.0


async def stream_configs(mesh: LocalCluster) -> dict:
    nc = await connect_nats(mesh.nats_url, name="steward-reader", settings=mesh.nats_settings())
    try:
        return {stream: (await nc.jetstream().stream_info(stream)).config for stream in ALL_STREAMS}
    finally:
        await nc.close()


async def test_no_member_but_the_steward_administers_or_reads_beyond_its_role_s_streams(mesh):
    before = await stream_configs(mesh)
    steward = await watcher(mesh)
    attackers = {role: await connect_as(mesh, f"evil-{role}") for role in ROLES}
    try:
        await steward.watch("$JS.API.>", from_attackers=True)
        attempted = []
        for role, nc in attackers.items():
            for stream in ALL_STREAMS:
                verbs = ADMIN_VERBS + (UNREADABLE_VERBS if stream not in READABLE[role] else ())
                for verb in verbs:
                    subject = f"$JS.API.{verb.format(s=stream)}"
                    # A body that would do harm if it got through: a one-message stream over prompts' subjects.
                    await nc.publish(subject, b'{"name":"%s","subjects":["llm.chat.request"],"max_msgs":1}'
                                     % stream.encode(), reply=nc.new_inbox())
                    attempted.append((role, subject))
            await flush_ordered(nc, DELIVERY_WAIT_S)
        await asyncio.sleep(DELIVERY_WAIT_S)
        assert steward.seen == [], f"the broker let through: {steward.seen}"
        unreadable = sum(len(ALL_STREAMS) - len(streams) for streams in READABLE.values())
        assert len(attempted) == len(ROLES) * len(ALL_STREAMS) * len(ADMIN_VERBS) + unreadable * len(UNREADABLE_VERBS)
    finally:
        for nc in attackers.values():
            await nc.close()
        await steward.nc.close()
    after = await stream_configs(mesh)
    assert after == before


@pytest.mark.parametrize("subject", [CHAT_REQUEST_SUBJECT, MODELS_REQUEST_SUBJECT])
async def test_a_request_whose_reply_is_not_the_caller_s_inbox_gets_no_answer_anywhere(mesh, subject):
    targets = ("hearth.events.pipeline.attack-1.completed", "_INBOX.evil-shard.stolen",
               f"$JS.API.STREAM.INFO.{PIPELINES_STREAM}")
    steward = await watcher(mesh)
    attacker = await connect_as(mesh, "evil-client")
    key = MemberKey.load(mesh.member_key("evil-client", "client"))
    refused_before = foreign_replies_refused(mesh)
    try:
        await steward.watch(*targets)
        body = REQUEST.model_dump_json(exclude_none=True).encode() if subject == CHAT_REQUEST_SUBJECT else b"{}"
        for reply in targets:
            # Signed, so the signature is good: only where the answer would go is wrong.
            await attacker.publish(subject, body, reply=reply,
                                   headers=signed_call_headers(key, subject, reply, body))
        await flush_ordered(attacker, DELIVERY_WAIT_S)
        await asyncio.sleep(DELIVERY_WAIT_S)
        assert steward.seen == [], f"the orchestrator answered into {steward.seen}"
    finally:
        await attacker.close()
        await steward.nc.close()
    assert foreign_replies_refused(mesh) >= refused_before + len(targets)


async def test_the_event_log_verifies_after_the_attacks(mesh):
    """Last in the module: whatever the attacks above did, nothing they sent was stored."""
    env = {**os.environ, **mesh.credentials_env(mesh.member_key("evil-auditor", "auditor")), "PYTHONUNBUFFERED": "1"}
    audit = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "hearth.services.replay.cli", "verify", "--nats", mesh.nats_url],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=REPLAY_TIMEOUT_S)
    assert audit.returncode == 0, audit.stdout + audit.stderr
