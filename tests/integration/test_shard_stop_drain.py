"""A `hearth shard` (or `hearth host`) stopped by SIGTERM while a call goes through it withdraws at once (an `open`
of a new call is refused `withdrawn`) and serves the call until its orchestrator closes the hop, for at most
`[shard] stop_drain_timeout_s`, then exits 0; a second SIGTERM ends it at once. Real processes: the command on a test
nats-server, the bundled tiny model's layers 0-1, the test's client standing in for an orchestrator."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import pytest

from hearth.events.consume import read_stream
from hearth.events.models import ShardWithdrawn
from hearth.events.streams import SHARDS_STREAM
from hearth.inference import weights_sha256
from hearth.protocol.control import CloseHop, ControlReply, OpenHop, ShardStat, StatShard
from hearth.protocol.subjects import shard_control_subject, shard_id_for
from hearth.services.broker.connection import connect_nats
from hearth.services.common.config import HearthSettings
from hearth.services.common.lifecycle import stop_deadline_s
from tests.integration.test_cli_faults import HEARTH, MODEL, Process, needs_model, started  # noqa: F401 (fixture)
from tests.integration.tiny_shard_server import CONTEXT

pytestmark = [pytest.mark.integration, pytest.mark.scheduled_first]

NODE = "draining-host"
# `hearth shard` serves the layers it is told; `hearth host`, with its budget left at [shard] max_memory_mb, all six.
SHARD_IDS = {"shard": shard_id_for("tiny", 0, 1, NODE), "host": shard_id_for("tiny", 0, 5, NODE)}
SUBJECT = shard_control_subject(NODE, SHARD_IDS["shard"])
reply_timeout_s = 5.0
# What a stop without a call in flight takes (tests/integration/test_cli_faults.py), and so what a second signal
# gives the shard to close what it still serves.
STOP_WITHIN_S = 2.0
# The test's client sends no keepalives: its hop must not be closed as an orphan meanwhile.
ENV = {"HEARTH_TRANSPORT__ORPHAN_TIMEOUT_S": "600"}


def shard_args(nats_url: str, command: str = "shard") -> list[str]:
    layers = ["--layers", "0-1"] if command == "shard" else []
    return [HEARTH, command, "--model", str(MODEL), "--model-id", "tiny", *layers, "--node-id", NODE,
            "--torch-threads", "1", "--busy-threads", "1", "--nats", nats_url]


def open_request(pipeline_id: str) -> bytes:
    return OpenHop(pipeline_id=pipeline_id, session_id="s", hop=0, hop_count=1, model_id="tiny",
                   weights_sha256=weights_sha256(MODEL), layer_lo=0, layer_hi=1,
                   max_session_tokens=CONTEXT).model_dump_json().encode()


async def ask(client, request: bytes, subject: str = SUBJECT) -> ControlReply:
    return ControlReply.model_validate_json((await client.request(subject, request, timeout=reply_timeout_s)).data)


@contextlib.asynccontextmanager
async def client_of(nats_url: str):
    client = await connect_nats(nats_url, name="orchestrator-stand-in", settings=HearthSettings().nats)
    try:
        yield client
    finally:
        await client.close()


async def withdrawals(nats_url: str) -> list[str]:
    async with client_of(nats_url) as nc:
        async with contextlib.aclosing(read_stream(nc.jetstream(), SHARDS_STREAM)) as messages:
            return [message.event.reason async for message in messages
                    if isinstance(getattr(message, "event", None), ShardWithdrawn)]


async def serving_a_call(process: Process, client, command: str = "shard") -> None:
    """The shard ready, with the hop of one call open on it."""
    shard_id = SHARD_IDS[command]
    await asyncio.to_thread(process.wait_for, f"shard {shard_id} ready")
    assert (await ask(client, open_request("call"), shard_control_subject(NODE, shard_id))).ok


async def refused_once_withdrawn(client, subject: str):
    """The refusal of a new call's open once the stopping shard has withdrawn (opens before that are closed again)."""
    async with asyncio.timeout(30):
        while (refused := await ask(client, open_request("later-call"), subject)).ok:
            await ask(client, CloseHop(pipeline_id="later-call").model_dump_json().encode(), subject)
            await asyncio.sleep(0.1)
    return refused


async def exited(process: Process, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    while process.popen.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return process.popen.poll()


@needs_model
@pytest.mark.parametrize("command", ["shard", "host"])
async def test_a_stopped_shard_withdraws_and_serves_the_call_in_flight_until_it_ends(command, nats_server, started):
    process = started(shard_args(nats_server.url, command), **ENV)
    subject = shard_control_subject(NODE, SHARD_IDS[command])
    async with client_of(nats_server.url) as client:
        await serving_a_call(process, client, command)
        process.popen.send_signal(signal.SIGTERM)
        refused = await refused_once_withdrawn(client, subject)
        assert refused.code == "withdrawn", refused
        await asyncio.sleep(stop_deadline_s + 1)  # past the stop deadline a process without calls gets
        # Before, the stop closed the call's hop at once (the orchestrator failed over, blaming this shard).
        stat = await client.request(subject, StatShard().model_dump_json().encode(), timeout=reply_timeout_s)
        assert ShardStat.model_validate_json(stat.data).open_pipelines == ["call"]
        assert process.popen.poll() is None, process.output()
        assert await withdrawals(nats_server.url) == ["shutdown"]
        assert (await ask(client, CloseHop(pipeline_id="call").model_dump_json().encode(), subject)).ok  # it ended
        assert await exited(process, 30) == 0, process.output()
    process.finish()
    assert "Traceback" not in process.text("stderr"), process.output()
    assert await withdrawals(nats_server.url) == ["shutdown"]


@needs_model
@pytest.mark.parametrize("command", ["shard", "host"])
async def test_a_second_sigterm_ends_a_draining_shard_at_once(command, nats_server, started):
    process = started(shard_args(nats_server.url, command), **ENV)
    subject = shard_control_subject(NODE, SHARD_IDS[command])
    async with client_of(nats_server.url) as client:
        await serving_a_call(process, client, command)
        process.popen.send_signal(signal.SIGTERM)
        await refused_once_withdrawn(client, subject)
        assert process.popen.poll() is None, process.output()
        process.popen.send_signal(signal.SIGTERM)
        assert await exited(process, STOP_WITHIN_S) == 0, process.output()
    process.finish()
    assert "Traceback" not in process.text("stderr"), process.output()


@needs_model
async def test_a_call_that_outlasts_the_stop_drain_is_closed_and_the_shard_exits(nats_server, started):
    process = started(shard_args(nats_server.url), **ENV, HEARTH_SHARD__STOP_DRAIN_TIMEOUT_S="1")
    async with client_of(nats_server.url) as client:
        await serving_a_call(process, client)
        process.popen.send_signal(signal.SIGTERM)
        assert await exited(process, 1 + STOP_WITHIN_S + 5) == 0, process.output()
    process.finish()
    assert "Traceback" not in process.text("stderr"), process.output()

