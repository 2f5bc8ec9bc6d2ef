"""A `hearth host` that moves to fill a hole while a call goes through its range lets that call end first: the range
is withdrawn at once (new calls are routed elsewhere, and an `open` that still reaches it is refused `withdrawn`),
the open hop keeps being served until its orchestrator closes it, and only then is the range stopped; a call that
does not end within `move_drain_timeout_s` is closed then; a host stopped while it drains says at once that its move
will not land, and lets the call end too (within `[shard] stop_drain_timeout_s`). Real nats-server, the bundled
tiny model's layers."""

from __future__ import annotations

import asyncio
import contextlib

from hearth.events.consume import read_stream
from hearth.events.models import ShardHeartbeat, ShardWithdrawn
from hearth.events.streams import SHARDS_STREAM, ensure_streams
from hearth.inference import weights_sha256
from hearth.protocol.control import CloseHop, ControlReply, OpenHop, ShardStat, StatShard
from hearth.protocol.subjects import shard_control_subject, shard_id_for
from hearth.services.broker.connection import connect_nats
from hearth.services.common.config import HearthSettings
from hearth.services.host.main import _serve_until_moved
from hearth.services.host.moving import Move, heartbeats_while_moving
from hearth.services.host.planner import LayerRange
from hearth.services.shard.kept_events import shard_outbox, start_outbox
from hearth.services.shard.metrics import ServingStats
from tests.integration.tiny_shard_server import CONTEXT, MODEL

LAYERS = 6
NODE = "mover"
reply_timeout_s = 5.0


class HoleWhenTold:
    """Coverage where every layer is held once elsewhere until `hole` is set; then layers 2-3 are held by nobody."""

    quantization = "none"

    def __init__(self) -> None:
        self.hole = asyncio.Event()
        self.stop_event = asyncio.Event()  # the host's (SIGTERM's)

    async def replicas(self, leave_out=frozenset()) -> list[int]:
        return [1, 1, 0, 0, 1, 1] if self.hole.is_set() else [1] * LAYERS

    async def turn(self, current, shard_id) -> int:
        return 0

    async def move_under_way(self, within_s: float) -> bool:
        return False


def settings_for(drain_s: float, **shard_settings) -> HearthSettings:
    settings = HearthSettings()
    settings = settings.model_copy(update={"shard": settings.shard.model_copy(update=shard_settings)})
    distributed = settings.research.distributed_inference
    host = distributed.host.model_copy(update={"rebalance_hold_s": 0.0, "rebalance_check_interval_s": 0.05,
                                               "move_drain_timeout_s": drain_s})
    return settings.model_copy(update={
        "research": settings.research.model_copy(update={"distributed_inference": distributed.model_copy(
            update={"host": host})}),
        # The test's client sends no keepalives: its hop must not be closed as an orphan meanwhile.
        "transport": settings.transport.model_copy(update={"orphan_timeout_s": 600.0})})


def open_request(pipeline_id: str) -> bytes:
    return OpenHop(pipeline_id=pipeline_id, session_id="s", hop=0, hop_count=1, model_id="tiny",
                   weights_sha256=weights_sha256(MODEL), layer_lo=0, layer_hi=1,
                   max_session_tokens=CONTEXT).model_dump_json().encode()


async def ask(client, subject: str, request: bytes) -> ControlReply:
    return ControlReply.model_validate_json((await client.request(subject, request, timeout=reply_timeout_s)).data)


@contextlib.asynccontextmanager
async def moving_host(nats_url: str, drain_s: float, **shard_settings):
    """The host serving layers 0-1 (a task running _serve_until_moved), its coverage, a client and the control
    subject, once the shard answers; all stopped and closed on exit."""
    settings = settings_for(drain_s, **shard_settings)
    coverage = HoleWhenTold()
    host_nc = await connect_nats(nats_url, name="host-under-test", settings=settings.nats)
    client = await connect_nats(nats_url, name="orchestrator-stand-in", settings=settings.nats)
    served = asyncio.create_task(_serve_until_moved(
        LayerRange(0, 1), coverage, host_nc, model=str(MODEL), model_id="tiny", node=NODE, settings=settings,
        device="cpu", dtype=None, nats_url=nats_url, layer_bytes=[100] * LAYERS, weights_budget=250,
        busy_threads=None, ready_file=None, stop_event=coverage.stop_event))
    subject = shard_control_subject(NODE, shard_id_for("tiny", 0, 1, NODE))
    try:
        async with asyncio.timeout(60):
            while True:
                assert not served.done(), served
                try:
                    await client.request(subject, StatShard().model_dump_json().encode(), timeout=0.5)
                    break
                except Exception:  # not serving yet
                    await asyncio.sleep(0.2)
        yield served, coverage, client, subject
    finally:
        served.cancel()
        await asyncio.gather(served, return_exceptions=True)
        await client.close()
        await host_nc.close()


async def test_a_moving_host_lets_the_call_open_on_its_range_end_before_it_stops_serving_it(nats_server):
    async with moving_host(nats_server.url, drain_s=60.0) as (served, coverage, client, subject):
        assert (await ask(client, subject, open_request("call"))).ok
        coverage.hole.set()  # the host decides to move to 2-3
        async with asyncio.timeout(30):
            while (refused := await ask(client, subject, open_request("later-call"))).ok:
                await ask(client, subject, CloseHop(pipeline_id="later-call").model_dump_json().encode())
                await asyncio.sleep(0.1)
        assert refused.code == "withdrawn", refused
        # Before, the move closed the call's hop at once (the orchestrator failed over, blaming this host).
        stat = await client.request(subject, StatShard().model_dump_json().encode(), timeout=reply_timeout_s)
        assert ShardStat.model_validate_json(stat.data).open_pipelines == ["call"] and not served.done()
        assert (await ask(client, subject, CloseHop(pipeline_id="call").model_dump_json().encode())).ok
        assert (await asyncio.wait_for(served, timeout=30)).to == LayerRange(2, 3)


async def test_a_call_that_outlasts_the_drain_is_closed_and_the_host_moves_on(nats_server):
    async with moving_host(nats_server.url, drain_s=0.5) as (served, coverage, client, subject):
        assert (await ask(client, subject, open_request("endless-call"))).ok
        coverage.hole.set()
        assert (await asyncio.wait_for(served, timeout=30)).to == LayerRange(2, 3)


async def test_a_host_stopped_while_it_drains_says_its_move_will_not_land(nats_server):
    """Its range was withdrawn as `moved`: other hosts hold their own moves while one is under way. Stopped before
    the new range was loaded, the host withdraws it again as a shutdown, and they decide again at once (before,
    they had no way to tell, and would wait the whole move_wait_max_s). The call going through it still ends well:
    a stop too lets it end, for at most `[shard] stop_drain_timeout_s`."""
    async with moving_host(nats_server.url, drain_s=60.0) as (served, coverage, client, subject):
        assert (await ask(client, subject, open_request("call"))).ok
        coverage.hole.set()
        async with asyncio.timeout(30):
            while (await ask(client, subject, open_request("later-call"))).ok:
                await ask(client, subject, CloseHop(pipeline_id="later-call").model_dump_json().encode())
                await asyncio.sleep(0.1)
        coverage.stop_event.set()  # SIGTERM while the call goes on
        # Said as the stop begins, while the call still goes on (before, only once the stop's drain had ended: the
        # others waited up to stop_drain_timeout_s longer).
        async with asyncio.timeout(10):
            while await withdrawals(nats_server.url) != ["moved", "shutdown"]:
                await asyncio.sleep(0.1)
        stat = await client.request(subject, StatShard().model_dump_json().encode(), timeout=reply_timeout_s)
        assert ShardStat.model_validate_json(stat.data).open_pipelines == ["call"] and not served.done()
        assert (await ask(client, subject, CloseHop(pipeline_id="call").model_dump_json().encode())).ok
        assert await asyncio.wait_for(served, timeout=30) is None
    assert await withdrawals(nats_server.url) == ["moved", "shutdown"]  # said once


async def test_a_move_abandoned_while_the_broker_is_down_is_kept_for_the_node_s_next_host(nats_server, tmp_path):
    """Said while the shard's own outbox held the node's first file, the withdrawal the broker did not take was kept
    in a second one, which only a second host of the node at once would write: it is kept in the first too, once
    the shard has stopped, and the node's next host writes it."""
    outbox_dir = tmp_path / "shard-outbox"
    async with moving_host(nats_server.url, drain_s=60.0, event_outbox_dir=outbox_dir,
                           withdraw_timeout_s=0.5) as (served, coverage, client, subject):
        assert (await ask(client, subject, open_request("call"))).ok
        coverage.hole.set()
        async with asyncio.timeout(30):
            while await withdrawals(nats_server.url) != ["moved"]:
                await asyncio.sleep(0.1)
        nats_server.stop()
        coverage.stop_event.set()
        assert await asyncio.wait_for(served, timeout=30) is None
    nats_server.start()
    nc = await connect_nats(nats_server.url, name="node-s-next-host", settings=HearthSettings().nats)
    try:  # as the node's next shard host starts: what the node's first file holds is written first
        await start_outbox(shard_outbox(nc, None), outbox_dir, NODE, timeout_s=10)
    finally:
        await nc.close()
    assert await withdrawals(nats_server.url) == ["moved", "shutdown"]


async def withdrawals(nats_url: str) -> list[str]:
    """The reasons of the withdrawals of the host's first range, in order."""
    shard_id = shard_id_for("tiny", 0, 1, NODE)
    return [event.reason for event in await shard_events(nats_url)
            if isinstance(event, ShardWithdrawn) and event.shard_id == shard_id]


async def test_a_moving_host_heartbeats_the_range_it_left_until_its_new_one_is_advertised(nats_server):
    """Others hold their moves while one is under way, only while they hear from the mover (CoverageReader.
    move_under_way): while it loads the new range its heartbeats of the range it left go on, with the figures that
    range served with (the read model's token count of that shard stays), and stop once the new range is
    advertised."""
    settings = HearthSettings()
    settings = settings.model_copy(update={"shard": settings.shard.model_copy(update={"heartbeat_interval_s": 0.2})})
    served = ServingStats(tokens_served_total=7)
    left = shard_id_for("tiny", 0, 1, NODE)
    landed = asyncio.Event()
    nc = await connect_nats(nats_server.url, name="host-under-test", settings=settings.nats)
    try:
        await ensure_streams(nc.jetstream())
        beating = asyncio.create_task(heartbeats_while_moving(nc, settings, NODE, Move(LayerRange(2, 3), left, served),
                                                              landed))
        await asyncio.sleep(1.0)  # loading
        landed.set()
        await asyncio.wait_for(beating, timeout=5)
        beats = [event for event in await shard_events(nats_server.url) if isinstance(event, ShardHeartbeat)]
        assert len(beats) >= 3, beats
        assert {(beat.shard_id, beat.node_id, beat.tokens_served_total, beat.active_streams) for beat in beats} == {
            (left, NODE, 7, 0)}
        await asyncio.sleep(0.6)
        assert len([event for event in await shard_events(nats_server.url) if isinstance(event, ShardHeartbeat)]) \
            == len(beats)
    finally:
        await nc.close()


async def shard_events(nats_url: str) -> list:
    nc = await connect_nats(nats_url, name="e2e-reader", settings=HearthSettings().nats)
    try:
        async with contextlib.aclosing(read_stream(nc.jetstream(), SHARDS_STREAM)) as messages:
            return [message.event async for message in messages if getattr(message, "event", None) is not None]
    finally:
        await nc.close()
