"""What a hop may be asked to hold is bounded by the model, not by its `open`: a max_session_tokens beyond the model's
context is refused (before, its step limits came from it, and two 1-KiB frames of chunks past the first made the
receiver allocate and zero a gigabyte), and the hop's receiver takes the host's `[transport]` bounds."""

from __future__ import annotations

from hearth.protocol.control import ControlReply, OpenHop
from tests.integration.tiny_shard_server import CONTEXT, tiny_shard_server

reply_timeout_s = 5.0
configured_partial_steps = 3
configured_ready_steps = 2
configured_step_bytes = 2**18


def _open(pipeline_id: str, max_session_tokens: int) -> bytes:
    return OpenHop(pipeline_id=pipeline_id, session_id="s", hop=0, hop_count=1, model_id="tiny",
                   weights_sha256="0" * 64, layer_lo=0, layer_hi=1,
                   max_session_tokens=max_session_tokens).model_dump_json().encode()


async def _ask(shard, request: bytes) -> ControlReply:
    message = await shard.client.request(shard.subject, request, timeout=reply_timeout_s)
    return ControlReply.model_validate_json(message.data)


async def test_an_open_beyond_the_models_context_is_refused(nats_server):
    async with tiny_shard_server(nats_server.url) as shard:
        reply = await _ask(shard, _open("pipe-huge", 2**40))
        assert (reply.ok, reply.code) == (False, "bad_request")
        assert "context of 512" in reply.message and "\n" not in reply.message
        assert shard.server.active_streams == 0
        assert (await _ask(shard, _open("pipe-honest", CONTEXT))).ok


async def test_a_hops_receiver_takes_the_hosts_transport_bounds(nats_server, monkeypatch):
    monkeypatch.setenv("HEARTH_TRANSPORT__MAX_PARTIAL_STEPS", str(configured_partial_steps))
    monkeypatch.setenv("HEARTH_TRANSPORT__MAX_READY_STEPS", str(configured_ready_steps))
    monkeypatch.setenv("HEARTH_TRANSPORT__MAX_STEP_BYTES", str(configured_step_bytes))
    async with tiny_shard_server(nats_server.url) as shard:
        assert (await _ask(shard, _open("pipe", CONTEXT))).ok
        receiver = shard.server._hops["pipe"].receiver
        assert receiver.max_partial_steps == configured_partial_steps
        assert receiver.max_ready_steps == configured_ready_steps
        assert receiver.max_step_bytes == configured_step_bytes  # below the pipeline's own bound (512 x 256 x 5)
