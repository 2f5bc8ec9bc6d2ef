"""Attacks on a real secure mesh by members acting within their credentials: a shard member forging hop notices
about other hops of a running pipeline, a shard host lying that its input from the hop before failed a check, and
a client signing calls with a `nan` timestamp or a multi-megabyte nonce. Each is refused or harmless: the call is
answered `done`, and no event blames an innocent host.

One mesh serves the module: honest shards h0-h2 (hop_weight 1, with /metrics) over layers 0-1, 2-3, 4-5, a
replica r0 of hop 0's layers (hop_weight 2, routed to only when h0 is not), and an orchestrator without a local
model (a call that cannot be served on the mesh fails)."""

from __future__ import annotations

import asyncio
import math

import pytest

from hearth.protocol.subjects import node_token
from hearth.services.common.call_signing import (
    HEADER_CALLER,
    HEADER_CALLER_NONCE,
    HEADER_CALLER_SIGNATURE,
    HEADER_CALLER_TIME,
    signed_call_headers,
)
from hearth.protocol.chat import ChatRequest
from hearth.protocol.chat_frames import decode_frame
from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT
from hearth.protocol.control import HopNotice
from hearth.protocol.subjects import hop_notice_subject
from hearth.services.broker.connection import connect_nats, flush_ordered
from hearth.services.broker.listen_ports import free_tcp_port
from hearth.services.transport.headers import HEADER_PIPELINE, HEADER_SESSION, HEADER_STEP
from hearth.services.transport.mac import new_link_key, with_mac
from tests.e2e.conftest import THREE_SHARD_RANGES, TINY_MODEL_NAME
from tests.e2e.failover_support import (  # noqa: F401 (nc is a fixture)
    ACT_AFTER_TOKENS,
    PREFERRED_WEIGHT,
    PRIMARY_WEIGHT,
    chat_request,
    failover_mesh,
    nc,
    pipeline_events,
    run_reference_call,
    scrape_metric,
    stream_with_action,
)
from hearth.trust.keys import MemberKey

# r0 also checks h0's work (every call's first step is checked while the range is new), so it is measured too; this
# keeps the router from ever preferring it over h0 on a noisy measurement.
LAST_RESORT_WEIGHT = 50.0

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

FRAME_WAIT_S = 30.0
BLAMING_EVENTS = ("integrity.corruption_detected", "pipeline.shard_status")
HUGE_NONCE_CALLS = 40
HUGE_NONCE_CHARS = 2 * 1024 * 1024
# Well below what the nonces would hold if they were remembered (HUGE_NONCE_CALLS x HUGE_NONCE_CHARS).
RSS_ALLOWANCE_BYTES = 40 * 1024 * 1024
CALL_BODY = ChatRequest(model=TINY_MODEL_NAME, prompt="the lazy dog", max_tokens=1).model_dump_json().encode()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    with failover_mesh(tmp_path_factory, tiny_models_dir, "attacks-notices") as mesh:
        for index, (lo, hi) in enumerate(THREE_SHARD_RANGES):
            mesh.start_shard(f"h{index}", lo, hi, hop_weight=PRIMARY_WEIGHT, metrics_port=free_tcp_port(),
                             wait_ready=False)
        # Used last whatever the measurements (a weight above 1 always counts): only when h0 is routed around.
        mesh.start_shard("r0", *THREE_SHARD_RANGES[0], hop_weight=LAST_RESORT_WEIGHT, wait_ready=False)
        mesh.start_orchestrator(local_model=False)
        mesh.cluster.wait_all_ready()
        mesh.wait_all_advertised()
        yield mesh


@pytest.fixture(scope="module")
def reference(mesh):
    call = run_reference_call(mesh.cluster)
    assert call.final.type == "done", call.final
    return call


async def connect_as(mesh, name: str, role: str):
    return await connect_nats(mesh.cluster.nats_url, name=f"attacker-{name}",
                              settings=mesh.cluster.nats_settings(mesh.cluster.member_key(name, role)))


def forgeries(pipeline_id: str, session_id: str, step: int) -> list[tuple[HopNotice, dict[str, str] | None]]:
    """What shard member h1 (hop 1) might say about the other hops, and about itself without its notice key."""
    def notice(hop: int, problem: str, check: str | None = None) -> HopNotice:
        return HopNotice(pipeline_id=pipeline_id, session_id=session_id, hop=hop, step=step, problem=problem,
                         check=check, message="forged")

    told = [notice(2, "step_failed"), notice(0, "step_failed"), notice(2, "input_failed_check", "nan"),
            notice(1, "input_failed_check", "norm"), notice(0, "session_evicted")]
    unsigned = [(forged, None) for forged in told]
    # With a key of its own making: a MAC, but not the one of the hop it names.
    keyed = [(forged, with_mac(new_link_key(), {}, forged.model_dump_json().encode())) for forged in told]
    return unsigned + keyed


async def test_forged_notices_about_other_hops_are_dropped_and_blame_nobody(mesh, reference, nc):
    attacker = await connect_as(mesh, "h1", "shard")
    port = mesh.orchestrator.metrics_port
    refused_before = scrape_metric(port, "hearth_hop_notices_refused_total", {"reason": "mac"})
    sent = []

    async def on_frame(msg):
        # h1 sees its own inbound frames: the pipeline, the session and the step now out.
        headers = msg.headers or {}
        step = int(headers.get(HEADER_STEP, "0"))
        if step <= ACT_AFTER_TOKENS or (headers[HEADER_SESSION], step) in sent:
            return
        sent.append((headers[HEADER_SESSION], step))
        for forged, forged_headers in forgeries(headers[HEADER_PIPELINE], headers[HEADER_SESSION], step):
            await attacker.publish(hop_notice_subject(forged.pipeline_id), forged.model_dump_json().encode(),
                                   headers=forged_headers)

    subscription = await attacker.subscribe(f"hearth.act.{node_token('h1')}.>", cb=on_frame)
    await flush_ordered(attacker)
    try:
        call = await stream_with_action(nc, chat_request())
    finally:
        await subscription.unsubscribe()
        await attacker.close()

    assert sent, "the attacker saw no step of the call"
    assert call.final.type == "done", call.final
    assert call.token_ids == reference.token_ids
    assert not call.of_type("shard_failover") and not call.of_type("shard_status")
    events = [stored.event for stored in await pipeline_events(nc, call.pipeline_id)]
    assert not [event for event in events if event.type in BLAMING_EVENTS or event.type == "pipeline.failover"]
    refused = scrape_metric(port, "hearth_hop_notices_refused_total", {"reason": "mac"}) - refused_before
    assert refused >= len(forgeries("p", "s", 0)), refused


async def test_a_host_lying_about_its_input_gets_nobody_blamed(mesh, reference, nc):
    h0 = mesh.shards["h0"]
    liar = await asyncio.to_thread(mesh.start_shard, "x-accuser", *THREE_SHARD_RANGES[1],
                                   hop_weight=PREFERRED_WEIGHT, fault=f"after_steps={ACT_AFTER_TOKENS},accuse")
    try:
        await mesh.wait_advertised(liar)
        call = await stream_with_action(nc, chat_request())
        # Its word against h0 reroutes that call only: the next one is routed to h0 again.
        following = await stream_with_action(nc, chat_request())
    finally:
        await asyncio.to_thread(mesh.stop_shard, liar)

    assert call.first_hops[:2] == [h0.shard_id, liar.shard_id], call.first_hops
    assert call.final.type == "done", call.final
    assert call.token_ids == reference.token_ids
    events = [stored.event for stored in await pipeline_events(nc, call.pipeline_id)]
    assert not [event for event in events if event.type in BLAMING_EVENTS]
    # Routed around h0 once; when the same reporter, kept in the new chain, accused its new predecessor, around the
    # reporter itself. (The chain after h0 keeps the reporter only while its measured steps are not slower than
    # h1's: its declared preference counts until it is measured.)
    failovers = [event for event in events if event.type == "pipeline.failover"]
    reporter_kept = liar.shard_id in failovers[0].replacement_hops if failovers else False
    expected = [(h0.shard_id, "reported")] + ([(liar.shard_id, "reported")] if reporter_kept else [])
    assert [(event.failed_shard_id, event.reason) for event in failovers] == expected, failovers
    assert scrape_metric(mesh.orchestrator.metrics_port, "hearth_shard_corruption_detected_total",
                         {"shard_id": h0.shard_id}) == 0
    assert following.first_hops[0] == h0.shard_id, following.first_hops
    assert following.final.type == "done", following.final


def forged_call_headers(key: MemberKey, inbox: str, body: bytes, *, time_text: str, nonce: str) -> dict[str, str]:
    """Signing headers as docs/protocol.md defines them, over whatever time and nonce a forger chooses."""
    signed = f"hearth-call\n{CHAT_REQUEST_SUBJECT}\n{inbox}\n{time_text}\n{nonce}\n".encode() + body
    return {HEADER_CALLER: key.public_key, HEADER_CALLER_TIME: time_text, HEADER_CALLER_NONCE: nonce,
            HEADER_CALLER_SIGNATURE: key.sign_b64(signed)}


async def signed_call(client, key: MemberKey, *, body: bytes, time_text: str | None = None,
                      nonce: str | None = None):
    """Publish one call signed by `key` (over the given time and nonce, else as an honest signer would); the
    final frame of its answer, and the headers and inbox to replay it with."""
    inbox = client.new_inbox()
    headers = signed_call_headers(key, CHAT_REQUEST_SUBJECT, inbox, body)
    if time_text is not None or nonce is not None:
        headers = forged_call_headers(key, inbox, body, time_text=time_text or headers[HEADER_CALLER_TIME],
                                      nonce=nonce or headers[HEADER_CALLER_NONCE])
    return await final_frame(client, body, headers, inbox), headers, inbox


async def final_frame(client, body: bytes, headers: dict, inbox: str):
    subscription = await client.subscribe(inbox)
    try:
        await client.publish(CHAT_REQUEST_SUBJECT, body, reply=inbox, headers=headers)
        while True:
            frame = decode_frame((await subscription.next_msg(timeout=FRAME_WAIT_S)).data)
            if frame.type in ("done", "error", "pipeline_aborted"):
                return frame
    finally:
        await subscription.unsubscribe()


def outcome(frame) -> tuple[str, str | None]:
    return frame.type, getattr(frame, "code", None)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.fixture
async def mallory(mesh):
    """A client member of the community, its connection and its key."""
    client = await connect_as(mesh, "mallory", "client")
    try:
        yield client, MemberKey.load(mesh.cluster.member_key("mallory", "client"))
    finally:
        await client.close()


async def test_a_call_timed_nan_is_refused_and_so_is_its_replay(mallory):
    client, key = mallory
    honest, _, _ = await signed_call(client, key, body=CALL_BODY)
    assert honest.type == "done", honest
    # `nan` is no time: never fresh, so never answered, however often it is replayed.
    refused, headers, inbox = await signed_call(client, key, body=CALL_BODY, time_text=str(math.nan))
    assert outcome(refused) == ("error", "unauthorized"), refused
    replay = await final_frame(client, CALL_BODY, headers, inbox)
    assert outcome(replay) == ("error", "unauthorized"), replay


async def test_calls_with_huge_nonces_are_refused_and_leave_nothing_behind(mesh, mallory):
    client, key = mallory
    # A nonce longer than signers write: refused before it is remembered.
    refused, _, _ = await signed_call(client, key, body=CALL_BODY, nonce="ab" * 64)
    assert outcome(refused) == ("error", "unauthorized"), refused
    # Multi-megabyte nonces: refused for their headers' size, and nothing of them stays behind.
    pid = mesh.orchestrator.popen.pid
    before = rss_bytes(pid)
    for index in range(HUGE_NONCE_CALLS):
        nonce = f"{index:08x}" + "0" * (HUGE_NONCE_CHARS - 8)
        refused, _, _ = await signed_call(client, key, body=CALL_BODY, nonce=nonce)
        assert outcome(refused) == ("error", "bad_request"), refused
        assert "headers" in refused.message
    grown = rss_bytes(pid) - before
    print(f"{HUGE_NONCE_CALLS} calls with {HUGE_NONCE_CHARS / 2**20:.0f} MiB nonces: orchestrator RSS "
          f"{before / 2**20:.0f} -> {(before + grown) / 2**20:.0f} MiB")
    assert grown < RSS_ALLOWANCE_BYTES
    honest, _, _ = await signed_call(client, key, body=CALL_BODY)
    assert honest.type == "done", honest
