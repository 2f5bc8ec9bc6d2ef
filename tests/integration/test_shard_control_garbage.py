"""A shard fed garbage by a member keeps serving: every malformed control request (bytes that are no JSON, nesting past
any parser, a body of megabytes, huge numbers, a key carrying a line break and an escape sequence) is answered
`bad_request` in one line, one without a reply subject changes nothing, junk frames on an open hop's subject are
dropped; and then `stat`, `open` and `close` are answered as ever (hearth/services/shard/server.py)."""

from __future__ import annotations

import json

from hearth.protocol.control import CloseHop, ControlReply, ShardStat, StatShard
from tests.integration.test_shard_control_while_busy import control_reply_timeout_s, open_request
from tests.integration.tiny_shard_server import tiny_shard_server
from tests.hostile_json import one_showable_line

GARBAGE = [
    b"\xff\xfe\x00",
    b"",
    b'{"op":"open","prefix":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    json.dumps({"op": "stat", "claim": "x" * 4_000_000}).encode(),
    b'{"op":"open","pipeline_id":"p","session_id":"s","hop":1e400,"hop_count":18446744073709551616,'
    b'"model_id":"tiny","weights_sha256":"0","layer_lo":-1,"layer_hi":NaN}',
    b'{"op":"close","pipeline_id":"pipeline-a","keep":{"\\n\\u001b[2J\\u202e":1}}',
    b'{"op":"stat\\n"}',
]


async def test_garbage_on_the_control_and_activation_subjects_leaves_the_shard_serving(nats_server):
    async with tiny_shard_server(nats_server.url) as shard:
        server, client, subject = shard.server, shard.client, shard.subject
        opened = ControlReply.model_validate_json((await client.request(
            subject, open_request("pipeline-a", 1), timeout=control_reply_timeout_s)).data)
        assert opened.ok
        hop = server._hops["pipeline-a"]
        for body in GARBAGE:
            await client.publish(subject, body)  # no reply subject: nothing to answer
            await client.publish(hop.receiver.subject, body, headers={"Hearth-Chunk": "0/1", "Hearth-Shape": "0,9"})
            reply = ControlReply.model_validate_json((await client.request(
                subject, body, timeout=control_reply_timeout_s)).data)
            assert (reply.ok, reply.code) == (False, "bad_request"), (body[:80], reply)
            assert reply.message and one_showable_line(reply.message), reply.message

        stat = ShardStat.model_validate_json((await client.request(
            subject, StatShard().model_dump_json().encode(), timeout=control_reply_timeout_s)).data)
        assert stat.open_pipelines == ["pipeline-a"]
        assert hop.receiver.stats.bad_frames >= len(GARBAGE)
        second = await client.request(subject, open_request("pipeline-b", 1), timeout=control_reply_timeout_s)
        assert ControlReply.model_validate_json(second.data).ok
        closed = await client.request(subject, CloseHop(pipeline_id="pipeline-a").model_dump_json().encode(),
                                      timeout=control_reply_timeout_s)
        assert ControlReply.model_validate_json(closed.data).ok and server.active_streams == 1
