"""Signed calls on a community mesh: an orchestrator answers only calls signed by a roster member with enough
trust, refuses unsigned, foreign, tampered and replayed ones as `unauthorized`, and records who called (never
the prompt) in the pipeline's events; the steward's `system` role, reading every control subject, sees no key a hop
was opened with (docs/protocol.md, Sealed hop keys)."""

from __future__ import annotations

import asyncio
import json

import pytest

from hearth.services.devtools.local_cluster import LocalCluster
from hearth.services.common.call_signing import signed_call_headers
from hearth.services.client.chat import chat
from hearth.protocol.chat import ChatRequest
from hearth.protocol.chat_frames import decode_frame
from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT
from hearth.services.broker.connection import connect_nats
from tests.e2e.conftest import TINY_MODEL_NAME, three_shard_mesh
from tests.e2e.failover_support import pipeline_events
from hearth.trust.keys import MemberKey

pytestmark = pytest.mark.e2e
REQUEST = ChatRequest(model=TINY_MODEL_NAME, prompt="the lazy dog", max_tokens=3)
FRAME_WAIT_S = 20


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    with three_shard_mesh(tmp_path_factory.mktemp("signed-calls"), tiny_models_dir) as cluster:
        yield cluster


async def connect_as(mesh: LocalCluster, name: str):
    return await connect_nats(mesh.nats_url, name=name, settings=mesh.nats_settings(mesh.member_key(name, "client")))


async def final_frame(nc, body: bytes, headers: dict | None):
    """Publish one raw call with `headers` and return the final frame of its answer."""
    inbox = nc.new_inbox()
    subscription = await nc.subscribe(inbox)
    try:
        await nc.publish(CHAT_REQUEST_SUBJECT, body, reply=inbox, headers=headers)
        while True:
            frame = decode_frame((await subscription.next_msg(timeout=FRAME_WAIT_S)).data)
            if frame.type in ("done", "error", "pipeline_aborted"):
                return frame, inbox
    finally:
        await subscription.unsubscribe()


async def test_a_member_s_signed_call_is_answered_and_its_caller_recorded(mesh):
    # The steward's `system` role may subscribe to everything: it watches the shards' control subjects.
    watcher = await connect_nats(mesh.nats_url, name="watcher", settings=mesh.nats_settings())
    seen: list[dict] = []

    async def heard(message) -> None:
        seen.append(json.loads(message.data))

    await watcher.subscribe("hearth.ctl.>", cb=heard)
    nc = await connect_as(mesh, "alice")
    try:
        result = await chat(nc, REQUEST)
        assert result.ok, result.final
        pipeline_id = result.frames_of("pipeline")[0].pipeline_id
        events = [stored.event for stored in await pipeline_events(watcher, pipeline_id)]
        for _ in range(100):  # closes go out without waiting for answers: they may come after the last frame
            if any(request.get("op") == "close" and request["pipeline_id"] == pipeline_id for request in seen):
                break
            await asyncio.sleep(0.05)
    finally:
        await nc.close()
        await watcher.close()
    # It saw the call's opens and closes, but no key a hop was opened with: sealed to each host, proven by HMAC.
    opens = [request for request in seen if request.get("op") == "open" and request["pipeline_id"] == pipeline_id]
    closes = [request for request in seen if request.get("op") == "close" and request["pipeline_id"] == pipeline_id]
    assert opens and closes
    for request in opens:
        assert request.get("sealed_keys") and not any(request.get(name) for name in (
            "inbound_link_key", "outbound_link_key", "notice_key", "owner_key"))
    assert all(request.get("owner_key") is None and request.get("owner_proof") for request in closes)
    constructed = next(event for event in events if event.type == "pipeline.constructed")
    assert constructed.caller == "alice"
    assert all(REQUEST.prompt not in json.dumps(event.model_dump(mode="json")) for event in events)


async def test_unsigned_foreign_tampered_and_replayed_calls_are_unauthorized(mesh):
    nc = await connect_as(mesh, "bob")
    body = REQUEST.model_dump_json(exclude_none=True).encode()
    bob = MemberKey.load(mesh.member_key("bob", "client"))
    try:
        unsigned, _ = await final_frame(nc, body, None)
        assert (unsigned.type, unsigned.code) == ("error", "unauthorized"), unsigned
        assert "not signed" in unsigned.message

        stranger = MemberKey.generate()
        inbox = nc.new_inbox()
        foreign, _ = await final_frame(nc, body, signed_call_headers(stranger, CHAT_REQUEST_SUBJECT, inbox, body))
        assert (foreign.type, foreign.code) == ("error", "unauthorized")

        # Signed for another body than the one sent, or for another inbox than the one answered to.
        tampered, _ = await final_frame(nc, body.replace(b"lazy", b"busy"),
                                        signed_call_headers(bob, CHAT_REQUEST_SUBJECT, nc.new_inbox(), body))
        assert (tampered.type, tampered.code) == ("error", "unauthorized")
        assert "signature" in tampered.message

        # The same signed call twice: the first is answered, the replay is refused.
        inbox = nc.new_inbox()
        headers = signed_call_headers(bob, CHAT_REQUEST_SUBJECT, inbox, body)
        subscription = await nc.subscribe(inbox)
        await nc.publish(CHAT_REQUEST_SUBJECT, body, reply=inbox, headers=headers)
        frames = []
        while not frames or frames[-1].type not in ("done", "error"):
            frames.append(decode_frame((await subscription.next_msg(timeout=FRAME_WAIT_S)).data))
        assert frames[-1].type == "done", frames[-1]
        await nc.publish(CHAT_REQUEST_SUBJECT, body, reply=inbox, headers=headers)
        replay = decode_frame((await subscription.next_msg(timeout=FRAME_WAIT_S)).data)
        await subscription.unsubscribe()
        assert (replay.type, replay.code) == ("error", "unauthorized") and "already" in replay.message
    finally:
        await nc.close()


async def test_calls_are_answered_again_after_a_refusal(mesh):
    """A refusal is the end of that call only: the orchestrator keeps answering others at once."""
    nc = await connect_as(mesh, "carol")
    try:
        body = REQUEST.model_dump_json(exclude_none=True).encode()
        refused, _ = await final_frame(nc, body, None)
        assert refused.code == "unauthorized"
        result = await asyncio.wait_for(chat(nc, REQUEST), timeout=FRAME_WAIT_S)
        assert result.ok, result.final
    finally:
        await nc.close()
