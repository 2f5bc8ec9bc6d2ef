"""A shard answers control requests concurrently, each in a task of its own, and an `open` may wait for the compute
thread (the hop it re-opens is reset there first). So a member signing a burst of re-opens of its own hop while a long
step runs would park a task, a hop and its `open` (up to 8192 block names) per request, and hold the shard's open/close
order for every other member while they drain; now one opener has at most max_concurrent_streams opens in progress
on a shard, and a further one is refused `at_capacity` at once."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import datetime, timezone

from hearth.inference.compute_thread import on_compute_thread
from hearth.protocol.control import ControlReply, KeepHop, OpenHop, PrefixBlocks
from hearth.services.common.call_signing import CallVerifier
from hearth.services.orchestrator.hop_owner import open_signer, owner_key
from hearth.trust.keys import MemberKey
from hearth.trust.roster import Roster, new_member
from tests.integration.tiny_shard_server import CONTEXT, tiny_shard_server

reply_timeout_s = 20.0
burst = 40
# How long a test holds the compute thread at most, waiting for what should be answered meanwhile.
busy_s = 5.0
streams = 4


def _open(pipeline_id: str, session_id: str) -> bytes:
    return OpenHop(pipeline_id=pipeline_id, session_id=session_id, hop=0, hop_count=1, model_id="tiny",
                   weights_sha256="0" * 64, layer_lo=0, layer_hi=1, max_session_tokens=CONTEXT,
                   owner_key=owner_key(pipeline_id, "tiny-0-1")).model_dump_json().encode()


async def _ask(shard, body: bytes, key: MemberKey) -> ControlReply:
    headers = open_signer(key)(shard.subject, body)
    message = await shard.client.request(shard.subject, body, timeout=reply_timeout_s, headers=headers)
    return ControlReply.model_validate_json(message.data)


async def test_a_burst_of_re_opens_holds_at_most_max_concurrent_streams_opens_in_progress(nats_server, monkeypatch):
    monkeypatch.setenv("HEARTH_SHARD__MAX_CONCURRENT_STREAMS", str(streams))
    hogger, other = MemberKey.generate(), MemberKey.generate()
    roster = Roster(community="t", created_at=datetime.now(timezone.utc))
    roster = roster.with_member(new_member("hogger", "orchestrator", hogger.public_key, "trusted"))
    roster = roster.with_member(new_member("other", "orchestrator", other.public_key, "trusted"))
    async with tiny_shard_server(nats_server.url) as shard:
        shard.server.open_verifier = CallVerifier(roster, max_clock_skew_s=30, min_caller_trust="member")
        assert (await _ask(shard, _open("hog", "s0"), hogger)).ok
        release = threading.Event()
        long_step = asyncio.ensure_future(on_compute_thread(release.wait, reply_timeout_s))  # the compute thread busy
        try:
            asks = [asyncio.ensure_future(_ask(shard, _open("hog", f"s{index}"), hogger))
                    for index in range(1, burst + 1)]
            deadline = time.monotonic() + busy_s
            # Until all but the opens it may hold are answered (none is before: the thread they wait for is busy).
            while sum(ask.done() for ask in asks) < burst - streams and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            held = len(shard.server._control_tasks)
            # Another member's open is not held behind them.
            assert (await _ask(shard, _open("other", "s"), other)).ok
        finally:
            release.set()
            await long_step
        replies = await asyncio.gather(*asks)
        assert held <= streams, held
        refused = [reply for reply in replies if reply.code == "at_capacity"]
        assert len(refused) >= burst - streams, [reply.code for reply in replies]
        assert all("in progress" in reply.message for reply in refused)
        assert shard.server.active_streams == 2


async def test_a_burst_of_keeps_of_one_hop_queues_one_on_the_compute_thread(nats_server):
    """A `keep` copies KV on the compute thread, where every member's steps run: one hop's keeps run one at a time,
    and one asked while another runs keeps nothing (0 positions) rather than queue behind it."""
    async with tiny_shard_server(nats_server.url) as shard:
        assert (await shard.client.request(shard.subject, _open("hog", "s0"), timeout=reply_timeout_s)).data
        keep = KeepHop(pipeline_id="hog", session_id="s0", owner_key=owner_key("hog", "tiny-0-1"),
                       keep=PrefixBlocks(block_tokens=16, hashes=["0" * 32])).model_dump_json().encode()
        release = threading.Event()
        long_step = asyncio.ensure_future(on_compute_thread(release.wait, reply_timeout_s))
        try:
            asks = [asyncio.ensure_future(shard.client.request(shard.subject, keep, timeout=reply_timeout_s))
                    for _ in range(burst)]
            deadline = time.monotonic() + busy_s
            while sum(ask.done() for ask in asks) < burst - 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            answered_while_busy = sum(ask.done() for ask in asks)
        finally:
            release.set()
            await long_step
        replies = [ControlReply.model_validate_json(message.data) for message in await asyncio.gather(*asks)]
        assert answered_while_busy == burst - 1
        assert all(reply.ok and reply.cached_tokens == 0 for reply in replies)
