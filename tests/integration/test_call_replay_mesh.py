"""A signed call replayed to another orchestrator of the same mesh is refused: each orchestrator's own nonce cache
only sees the calls it took, so the nonce is also recorded mesh-wide (hearth/services/common/call_nonces.py), in a
JetStream key-value bucket where a second create of the same key fails. Without it a member who may publish on
`llm.chat.request` re-published a captured call to the queue group and the second orchestrator served it again (the
caller's share, the mesh's capacity and the usage events spent twice)."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from types import SimpleNamespace

import nats
import pytest
from nats.js.errors import APIError

from hearth.services.broker.connection import flush_ordered
from hearth.events.streams import StreamSetup
from hearth.protocol.chat import ChatRequest
from hearth.protocol.chat_frames import DoneFrame, Usage, decode_frame
from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT
from hearth.services.common.call_nonces import CALL_NONCES_BUCKET, CALL_NONCES_STREAM, MeshNonces
from hearth.services.common.call_signing import HEADER_CALLER_NONCE, signed_call_headers
from hearth.services.common.config import HearthSettings
from hearth.services.orchestrator.service import Orchestrator
from hearth.trust.keys import MemberKey
from hearth.trust.roster import Roster, new_member
from tests.orchestrator_stand_ins import admit_every_prompt

FRAME_WAIT_S = 10.0
REQUEST = ChatRequest(model="tiny", prompt="hello", max_tokens=1)


@pytest.fixture
def community(tmp_path):
    alice = MemberKey.generate()
    roster = Roster(community="t", created_at=datetime.now(timezone.utc)).with_member(
        new_member("alice", "client", alice.public_key, "trusted"))
    roster.save(tmp_path / "roster.json")
    return alice, tmp_path / "roster.json"


async def orchestrator(server_url: str, roster_file, node_id: str, served: list[str], monkeypatch) -> Orchestrator:
    """An orchestrator of the community (calls checked against its roster) that answers every admitted call with
    one done frame, noting in `served` which orchestrator served it."""
    nc = await nats.connect(server_url)
    settings = HearthSettings(nats={"url": server_url, "roster_file": roster_file})
    running = Orchestrator(nc, settings, node_id=node_id)
    running.enabled = True
    running.context = SimpleNamespace(running_calls=0)
    admit_every_prompt(running, monkeypatch)

    async def run_admitted(request, model, client, caller, prompt_ids, admission):
        served.append(node_id)
        await client.send(DoneFrame(seq=0, finish_reason="length", usage=Usage(prompt_tokens=3, completion_tokens=1)))

    running._run_admitted = run_admitted
    return running


async def frames_until_final(subscription) -> list:
    frames = []
    while not frames or frames[-1].type not in ("done", "error", "pipeline_aborted"):
        frames.append(decode_frame((await subscription.next_msg(timeout=FRAME_WAIT_S)).data))
    return frames


async def test_a_signed_call_replayed_to_another_orchestrator_is_refused(nats_server, community, monkeypatch):
    alice, roster_file = community
    served: list[str] = []
    first = await orchestrator(nats_server.url, roster_file, "orch-a", served, monkeypatch)
    second = await orchestrator(nats_server.url, roster_file, "orch-b", served, monkeypatch)
    caller = await nats.connect(nats_server.url)
    try:
        for running in (first, second):  # on an open broker each creates the bucket, as it does the streams
            await running.call_nonces.ready(StreamSetup(create=True))
        inbox = "_INBOX.alice.replayed"
        body = REQUEST.model_dump_json().encode()
        captured = SimpleNamespace(subject=CHAT_REQUEST_SUBJECT, reply=inbox, data=body,
                                   headers=signed_call_headers(alice, CHAT_REQUEST_SUBJECT, inbox, body))
        subscription = await caller.subscribe(inbox)
        await flush_ordered(caller)
        await asyncio.wait_for(first._serve(captured), FRAME_WAIT_S)
        assert [frame.type for frame in await frames_until_final(subscription)] == ["done"]
        # The same call as it went over the wire, re-published by a member with publish rights on the subject: the
        # queue group hands it to the other orchestrator, whose own nonce cache never saw it.
        await asyncio.wait_for(second._serve(captured), FRAME_WAIT_S)
        replay = (await frames_until_final(subscription))[-1]
        assert served == ["orch-a"]
        # Kept for the nonce window (2 x 30 s) and one clock skew more: orch-b's clock may run behind orch-a's.
        stored = await first.js.get_last_msg(CALL_NONCES_STREAM, f"$KV.{CALL_NONCES_BUCKET}.{alice.public_key}."
                                                                 f"{captured.headers[HEADER_CALLER_NONCE]}")
        assert stored.headers["Nats-TTL"] == "90" and stored.data == b"orch-a"
        assert (replay.type, replay.code) == ("error", "unauthorized"), replay
        assert "already" in replay.message
    finally:
        for running in (first, second):
            await running.nc.close()
            running._tmp_dir.cleanup()
        await caller.close()


async def test_no_record_is_kept_on_an_open_mesh(nats_server):
    """No roster: calls are unsigned, there is no nonce to record (and nobody to tell apart)."""
    nc = await nats.connect(nats_server.url)
    running = Orchestrator(nc, HearthSettings(nats={"url": nats_server.url}), node_id="orch-open")
    try:
        assert running.call_verifier is None and running.call_nonces is None
    finally:
        await nc.close()
        running._tmp_dir.cleanup()


async def test_a_record_is_taken_back_by_no_member(nats_server):
    """A delete marker on the key still counts as the record (a create expects no message at all), and the bucket
    refuses the rollup a purge is, so an orchestrator cannot clear a nonce for a replay either."""
    nc = await nats.connect(nats_server.url)
    try:
        nonces = MeshNonces(nc.jetstream(), window_s=60, recorded_by="o" * 200)  # a value cut to fit the bucket
        await nonces.ready(StreamSetup(create=True))
        signer, nonce = MemberKey.generate().public_key, "ab" * 16
        assert await nonces.first_on_mesh(signer, nonce)
        assert not await nonces.first_on_mesh(signer, nonce)
        kv = await nc.jetstream().key_value(CALL_NONCES_BUCKET)
        await kv.delete(f"{signer}.{nonce}")
        assert not await nonces.first_on_mesh(signer, nonce)
        with pytest.raises(APIError):
            await kv.purge(f"{signer}.{nonce}")
        assert not await nonces.first_on_mesh(signer, nonce)
        assert await nonces.first_on_mesh(signer, "cd" * 16)  # another nonce of the same signer is its own call
    finally:
        await nc.close()


async def test_while_the_broker_is_away_a_call_is_admitted_and_its_nonce_recorded_once_it_is_back(
        nats_server, community, monkeypatch):
    """A JetStream outage (a leader election while a household link is cut) must not refuse every call: the answers
    travel on core NATS. The call is admitted, counted, and its nonce recorded in the background, so a replay after
    the outage is refused mesh-wide all the same."""
    from hearth.services.common.call_nonces import nonces_unrecorded_total

    alice, roster_file = community
    served: list[str] = []
    running = await orchestrator(nats_server.url, roster_file, "orch-a", served, monkeypatch)
    admitted_before = nonces_unrecorded_total.labels("admitted")._value.get()
    try:
        await running.call_nonces.ready(StreamSetup(create=True))
        running.call_nonces.timeout_s = 0.5
        await asyncio.to_thread(nats_server.stop)
        body = REQUEST.model_dump_json().encode()
        inbox = "_INBOX.alice.away"
        headers = signed_call_headers(alice, CHAT_REQUEST_SUBJECT, inbox, body)
        call = SimpleNamespace(subject=CHAT_REQUEST_SUBJECT, reply=inbox, data=body, headers=headers)
        assert await asyncio.wait_for(running._caller_admitted(call), FRAME_WAIT_S) == "alice"
        assert nonces_unrecorded_total.labels("admitted")._value.get() == admitted_before + 1
        await asyncio.to_thread(nats_server.start)
        deadline = asyncio.get_running_loop().time() + 30
        while running.call_nonces._recording_later:
            assert asyncio.get_running_loop().time() < deadline, "the nonce was never recorded once the broker was back"
            await asyncio.sleep(0.1)
        other = await nats.connect(nats_server.url)
        try:
            elsewhere = MeshNonces(other.jetstream(), window_s=60, recorded_by="orch-b")
            assert await elsewhere.first_on_mesh(alice.public_key, headers[HEADER_CALLER_NONCE]) is False
        finally:
            await other.close()
    finally:
        await running.call_nonces.close()
        await running.nc.close()
        running._tmp_dir.cleanup()
