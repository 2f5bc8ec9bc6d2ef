"""A hop closed while its long prefill runs on the shard's niced prefill thread ([shard] prefill_nice) leaves no KV
cache behind: that thread runs beside the compute thread, so the close's cache reset could come before the prefill's
turn had (re)created the session, which then stayed cached with no hop left to free it."""

from __future__ import annotations

import asyncio
import threading

import torch

from hearth.inference.compute_thread import on_thread, prefill_executor
from hearth.protocol.control import CloseHop, ControlReply, OpenHop
from hearth.protocol.subjects import LinkNodes
from hearth.services.transport import AckWindowSender, FrameKind, StepInfo
from tests.integration.tiny_shard_server import CONTEXT, tiny_shard_server

reply_timeout_s = 5.0
nice = 5
prompt_tokens = 32


async def test_a_hop_closed_during_its_prefill_on_the_niced_thread_keeps_no_cache(nats_server, monkeypatch):
    monkeypatch.setenv("HEARTH_SHARD__PREFILL_NICE", str(nice))
    monkeypatch.setenv("HEARTH_SHARD__PREFILL_SLICE_LAYERS", "1")
    monkeypatch.setenv("HEARTH_SHARD__PREFILL_SLICE_MIN_TOKENS", "8")
    monkeypatch.setenv("HEARTH_SHARD__MAX_BATCH_SESSIONS", "1")
    async with tiny_shard_server(nats_server.url) as shard:
        compute = shard.server.compute
        assert compute.prefill_nice == nice
        in_check, release = threading.Event(), threading.Event()
        check_input = compute._check_input

        def held_check(*check_args):
            # The prefill's trip has begun on the niced thread but not yet made the session: hold it there.
            if threading.current_thread().name.startswith("hearth-prefill"):
                in_check.set()
                assert release.wait(20.0)
            return check_input(*check_args)

        monkeypatch.setattr(compute, "_check_input", held_check)
        opened = OpenHop(pipeline_id="pipe", session_id="s", hop=0, hop_count=1, model_id="tiny",
                         weights_sha256="0" * 64, layer_lo=0, layer_hi=1, max_session_tokens=CONTEXT)
        reply = await shard.client.request(shard.subject, opened.model_dump_json().encode(), timeout=reply_timeout_s)
        assert ControlReply.model_validate_json(reply.data).ok
        sender = AckWindowSender(shard.client, "pipe", 0, nodes=LinkNodes(receiver="node0"))
        await sender.start()
        try:
            prompt = 0.1 * torch.randn(1, prompt_tokens, shard.runner.info.hidden_size)
            await sender.send(StepInfo(session="s", step=0, kind=FrameKind.prefill, pos=0), prompt)
            assert await asyncio.to_thread(in_check.wait, 20.0)
            closed = await shard.client.request(shard.subject, CloseHop(pipeline_id="pipe").model_dump_json().encode(),
                                                timeout=reply_timeout_s)
            assert ControlReply.model_validate_json(closed.data).ok
        finally:
            release.set()
            await sender.close()
        # Whatever the prefill thread still had to do for the closed hop is done once a later task on it has run.
        await asyncio.wait_for(on_thread(prefill_executor(nice), lambda: None), timeout=30.0)
        assert shard.runner.session_ids() == []
        assert shard.server.stat().cached_sessions == 0
