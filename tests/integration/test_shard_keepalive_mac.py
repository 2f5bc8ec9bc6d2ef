"""Only the orchestrator that opened a hop keeps it alive: a keepalive counts as a sign of life only with that hop's
MAC (a key derived from the notice key its `open` gave it) over a number it has not heard before, so another member
cannot hold a dead orchestrator's hop open past orphan_timeout_s by publishing on `hearth.keepalive.<pipeline_id>`,
nor replay a keepalive it saw; a hop opened without a notice key (an orchestrator from before them) counts any
keepalive, as before (hearth/services/shard/hops.py, hearth/services/transport/keepalives.py)."""

from __future__ import annotations

import asyncio

from hearth.protocol.control import ControlReply, OpenHop
from hearth.protocol.subjects import keepalive_subject
from hearth.services.transport.keepalives import KeepaliveSender
from hearth.services.transport.mac import encode_link_key, new_link_key
from tests.integration.tiny_shard_server import CONTEXT, tiny_shard_server

reply_timeout_s = 5.0
settle_s = 0.3  # long enough for the shard to have read what was published before


def open_hop(pipeline_id: str, notice_key: bytes | None) -> OpenHop:
    return OpenHop(pipeline_id=pipeline_id, session_id=f"{pipeline_id}-s", hop=0, hop_count=1, model_id="tiny",
                   weights_sha256="0" * 64, layer_lo=0, layer_hi=1, max_session_tokens=CONTEXT,
                   notice_key=None if notice_key is None else encode_link_key(notice_key))


async def test_only_the_openers_fresh_keepalive_keeps_a_hop_alive(nats_server):
    async with tiny_shard_server(nats_server.url) as shard:
        client = shard.client

        async def opened(request: OpenHop):
            reply = await client.request(shard.subject, request.model_dump_json().encode(), timeout=reply_timeout_s)
            assert ControlReply.model_validate_json(reply.data).ok
            return shard.server._hops[request.pipeline_id]

        async def heard_after(hop, publish) -> bool:
            before = hop.last_heard
            await publish()
            await client.flush(timeout=reply_timeout_s)
            await asyncio.sleep(settle_s)
            return hop.last_heard > before

        notice_key = new_link_key()
        hop = await opened(open_hop("pipeline-a", notice_key))
        subject = keepalive_subject("pipeline-a")
        captured: list = []

        async def keep(msg) -> None:
            captured.append(msg)

        capture = await client.subscribe(subject, cb=keep)

        # Another member, with no key of the hop's: an empty keepalive, or one MACed with a key of its own.
        assert not await heard_after(hop, lambda: client.publish(subject, b""))
        assert not await heard_after(hop, lambda: KeepaliveSender(0, [new_link_key()]).publish(client, subject))
        # The opener's keepalives count, each once: one seen and published again does not.
        opener = KeepaliveSender(0, [notice_key])
        assert await heard_after(hop, lambda: opener.publish(client, subject))
        authentic = captured[-1]
        assert not await heard_after(hop, lambda: client.publish(subject, authentic.data, headers=authentic.headers))
        assert await heard_after(hop, lambda: opener.publish(client, subject))
        await capture.unsubscribe()

        # A hop its orchestrator opened without a notice key takes any keepalive, as before.
        legacy = await opened(open_hop("pipeline-b", None))
        assert await heard_after(legacy, lambda: client.publish(keepalive_subject("pipeline-b"), b""))
