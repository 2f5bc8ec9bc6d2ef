"""Requests answered in tasks of their own (a shard's control requests, an orchestrator's calls) that fail
unexpectedly are logged by hearth, one line and its traceback, never left to asyncio's 'Task exception was never
retrieved' when the task is collected."""

from __future__ import annotations

import asyncio
import gc
import logging
from types import SimpleNamespace

from hearth.protocol.control import KeepHop, PrefixBlocks
from hearth.services.common.config import HearthSettings
from hearth.services.shard.identity import ShardIdentity
from hearth.services.shard.server import ShardServer


class _Connection:
    def jetstream(self):
        return object()


class _ComputeThatFails:
    async def keep_now(self, request, keep, opener) -> int:
        raise RuntimeError("CUDA out of memory")


class _KeepRequest:
    subject = "hearth.ctl.n.s"
    reply = "_INBOX.orch.1"
    headers = None

    def __init__(self) -> None:
        self.data = KeepHop(pipeline_id="p", session_id="s",
                            keep=PrefixBlocks(block_tokens=16, hashes=["0" * 32])).model_dump_json().encode()

    async def respond(self, data: bytes) -> None:
        pass


async def test_a_control_request_that_fails_is_logged_not_left_unretrieved(caplog):
    identity = ShardIdentity(shard_id="s", model_id="m", node_id="n", weights_sha256="w", layer_lo=0, layer_hi=3,
                             total_layers=8, dtype="float32", memory_required_mb=1.0, control_subject="hearth.ctl.n.s")
    compute = _ComputeThatFails()
    server = ShardServer(_Connection(), compute, identity, HearthSettings())
    server._claim.decide()
    open_hop = asyncio.Event()
    open_hop.set()
    request = SimpleNamespace(session_id="s", owner_key=None)
    server._hops["p"] = SimpleNamespace(open_settled=open_hop, opener=None, opener_key=None, request=request,
                                        keep_now=lambda keep: compute.keep_now(request, keep, None))
    unretrieved: list[dict] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda loop, context: unretrieved.append(context))
    try:
        with caplog.at_level(logging.WARNING):
            await server._on_control(_KeepRequest())
            (task,) = server._control_tasks
            await asyncio.wait({task}, timeout=5)
            del task
            gc.collect()
    finally:
        loop.set_exception_handler(None)

    assert unretrieved == []
    assert "CUDA out of memory" in caplog.text


class _ClosedConnection:
    stats = {"reconnects": 0}

    def jetstream(self):
        return object()

    def new_inbox(self) -> str:
        return "_INBOX.orch.2"

    async def subscribe(self, subject: str, **kwargs):
        raise ConnectionError("nats: connection closed")


class _ChatRequest:
    subject = "llm.chat.request"
    reply = "_INBOX.asker.1"
    data = b"{}"
    headers = None


async def test_a_chat_request_that_fails_before_its_call_is_logged_not_left_unretrieved(caplog):
    from hearth.services.orchestrator.service import Orchestrator

    orchestrator = Orchestrator(_ClosedConnection(), HearthSettings(), node_id="n")
    unretrieved: list[dict] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda loop, context: unretrieved.append(context))
    try:
        with caplog.at_level(logging.WARNING):
            await orchestrator._on_request(_ChatRequest())
            (task,) = orchestrator._tasks
            await asyncio.wait({task}, timeout=5)
            del task
            gc.collect()
    finally:
        loop.set_exception_handler(None)
        orchestrator.catalog.close()
        if orchestrator._tmp_dir is not None:
            orchestrator._tmp_dir.cleanup()

    assert unretrieved == []
    assert "connection closed" in caplog.text


class _BusyCompute:
    """A compute thread busy for good: a `keep` waits on it until cancelled."""

    async def keep_now(self, request, keep, opener) -> int:
        await asyncio.Event().wait()


class _Subscription:
    def __init__(self) -> None:
        self.active = True

    async def unsubscribe(self) -> None:
        self.active = False


class _OpenHop:
    def __init__(self) -> None:
        self.open_settled = asyncio.Event()
        self.open_settled.set()
        self.opener = None
        self.opener_key = None  # opened on an open mesh: no key the log could retire
        self.request = SimpleNamespace(session_id="s", owner_key=None)

    async def close(self, keep=None) -> int:
        return 0


async def test_stop_leaves_no_control_request_running_though_requests_keep_coming():
    identity = ShardIdentity(shard_id="s", model_id="m", node_id="n", weights_sha256="w", layer_lo=0, layer_hi=3,
                             total_layers=8, dtype="float32", memory_required_mb=1.0, control_subject="hearth.ctl.n.s")
    server = ShardServer(_Connection(), _BusyCompute(), identity, HearthSettings())
    server._claim.decide()
    server._hops["p"] = _OpenHop()
    subscription = server._control_sub = _Subscription()

    async def broker() -> None:  # delivers a request at every turn of the loop while the subscription lasts
        while subscription.active:
            await server._on_control(_KeepRequest())
            await asyncio.sleep(0)

    delivering = asyncio.create_task(broker())
    await asyncio.sleep(0.01)
    await asyncio.wait_for(server.stop(), timeout=5)
    delivering.cancel()

    assert [task for task in server._control_tasks if not task.done()] == []


async def test_the_advertise_loop_cancelled_as_a_reconnect_asks_for_an_advert_ends():
    identity = ShardIdentity(shard_id="s", model_id="m", node_id="n", weights_sha256="w", layer_lo=0, layer_hi=3,
                             total_layers=8, dtype="float32", memory_required_mb=1.0, control_subject="hearth.ctl.n.s")
    server = ShardServer(_Connection(), _BusyCompute(), identity, HearthSettings())
    server._claim.decide()
    loop = asyncio.create_task(server._advertise_loop())
    await asyncio.sleep(0.01)  # waiting for the next advertisement
    server.request_readvertise()  # a reconnect, in the very turn the shard stops
    loop.cancel()
    await asyncio.wait({loop}, timeout=2)
    if not loop.done():
        loop.cancel()  # the loop that went on: not left behind by this test

    assert loop.cancelled()
