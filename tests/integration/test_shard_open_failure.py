"""An `open` that fails after the hop was registered (its kept prefix cannot be attached, its subscriptions cannot be
made) is answered with a refusal and leaves no half-open hop behind; before, the answering task died unanswered and
the hop stayed listed until the watchdog dropped it."""

from __future__ import annotations

from hearth.protocol.control import ControlReply, OpenHop, ShardStat, StatShard
from tests.integration.tiny_shard_server import CONTEXT, tiny_shard_server

reply_timeout_s = 5.0


async def test_an_open_failing_midway_is_refused_and_leaves_nothing_open(nats_server):
    async with tiny_shard_server(nats_server.url) as shard:
        async def no_prefix(request, opener) -> int:
            raise RuntimeError("the compute thread failed")

        shard.server.compute.attach_prefix = no_prefix
        request = OpenHop(pipeline_id="pipeline-a", session_id="s", hop=0, hop_count=1, model_id="tiny",
                          weights_sha256="0" * 64, layer_lo=0, layer_hi=1, max_session_tokens=CONTEXT)
        message = await shard.client.request(shard.subject, request.model_dump_json().encode(), timeout=reply_timeout_s)
        reply = ControlReply.model_validate_json(message.data)
        assert (reply.ok, reply.code) == (False, "bad_request") and "RuntimeError" in reply.message
        stat = await shard.client.request(shard.subject, StatShard().model_dump_json().encode(),
                                          timeout=reply_timeout_s)
        assert ShardStat.model_validate_json(stat.data).open_pipelines == []
        assert shard.server.active_streams == 0
