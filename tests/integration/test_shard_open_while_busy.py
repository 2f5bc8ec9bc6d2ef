"""An `open` that waits for the compute thread (it names a kept prefix, or re-opens a hop whose session must be reset)
does so outside the lock that serialises hop changes: another member's `open` is answered at once meanwhile, a
close of the pipeline being opened ends it cleanly, and no hop nor session is left behind
(hearth/services/shard/server.py)."""

from __future__ import annotations

import asyncio
import threading

from hearth.inference.compute_thread import on_compute_thread
from hearth.protocol.control import CloseHop, ControlReply, OpenHop, PrefixBlocks, ShardStat, StatShard
from hearth.services.orchestrator.hop_owner import owner_key
from tests.integration.tiny_shard_server import CONTEXT, tiny_shard_server

control_reply_timeout_s = 5.0
held_reply_timeout_s = 60.0
KEPT = PrefixBlocks(block_tokens=32, hashes=["0" * 32])


def open_hop(pipeline_id: str, session: str = "s1", prefix: PrefixBlocks | None = None) -> OpenHop:
    return OpenHop(pipeline_id=pipeline_id, session_id=f"{pipeline_id}-{session}", hop=0, hop_count=1,
                   model_id="tiny", weights_sha256="0" * 64, layer_lo=0, layer_hi=1, max_session_tokens=CONTEXT,
                   owner_key=owner_key(pipeline_id, "tiny-0-1"), prefix=prefix)


async def until(condition, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


async def test_opens_waiting_for_the_compute_thread_hold_up_no_other_open(nats_server):
    compute_thread_held = threading.Event()
    blocker = None
    async with tiny_shard_server(nats_server.url) as shard:
        server, runner = shard.server, shard.runner

        def ask(request, timeout_s: float = control_reply_timeout_s):
            return asyncio.ensure_future(shard.client.request(shard.subject, request.model_dump_json().encode(),
                                                              timeout=timeout_s))

        async def answer(request, timeout_s: float = control_reply_timeout_s) -> ControlReply:
            return ControlReply.model_validate_json((await ask(request, timeout_s)).data)

        try:
            assert (await answer(open_hop("pipeline-r"))).ok
            # The compute thread is busy (a long prefill step, say).
            blocker = asyncio.ensure_future(on_compute_thread(compute_thread_held.wait, 60.0))
            # A re-open (its old session's reset), an open naming a kept prefix, and an open of a pipeline closed
            # before its open ends: each waits for the compute thread.
            reopening = ask(open_hop("pipeline-r", session="s2"), held_reply_timeout_s)
            with_prefix = ask(open_hop("pipeline-p", prefix=KEPT), held_reply_timeout_s)
            closed_early = ask(open_hop("pipeline-c", prefix=KEPT), held_reply_timeout_s)
            await until(lambda: server.active_streams == 3)  # all three places are taken while they wait
            closing = ask(CloseHop(pipeline_id="pipeline-c", owner_key=owner_key("pipeline-c", "tiny-0-1")),
                          held_reply_timeout_s)
            await until(lambda: server.active_streams == 2)

            # Another member's plain open is answered within the orchestrator's control timeout.
            assert (await answer(open_hop("pipeline-b"))).ok
            assert not (reopening.done() or with_prefix.done() or closed_early.done())
            stat = ShardStat.model_validate_json((await ask(StatShard())).data)
            assert stat.open_pipelines == ["pipeline-b", "pipeline-p", "pipeline-r"]

            compute_thread_held.set()
            assert ControlReply.model_validate_json((await reopening).data).ok
            assert ControlReply.model_validate_json((await with_prefix).data).ok
            early = ControlReply.model_validate_json((await closed_early).data)
            assert (early.ok, early.code) == (False, "unknown_pipeline")
            assert ControlReply.model_validate_json((await closing).data).ok
            stat = ShardStat.model_validate_json((await ask(StatShard())).data)
            assert stat.open_pipelines == ["pipeline-b", "pipeline-p", "pipeline-r"]
            # The replaced session and the one closed while it was being opened hold no cache.
            sessions = runner.session_ids()
            assert "pipeline-r/pipeline-r-s1" not in sessions and "pipeline-c/pipeline-c-s1" not in sessions
            # The closed pipeline's hop does not listen: nothing of it is left to serve.
            assert "pipeline-c" not in server._hops
        finally:
            compute_thread_held.set()
            if blocker is not None:
                await blocker
