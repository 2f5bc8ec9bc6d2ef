"""One shard id, one process: a shard starting under an id another live process serves (same node, range and scheme)
refuses in one line instead of sharing its subjects, and withdraws nothing; of processes starting under one id at
the same moment exactly one serves, whatever claims others send on its control subject; one whose earlier run is gone
starts; and an answer that comes after a newcomer's deadline, or a claim heard only once a process reconnects, still
leaves exactly one serving."""

from __future__ import annotations

import asyncio
import json

import pytest

from hearth.protocol.control import ShardStat, StatShard
from hearth.protocol.subjects import EVENTS_PREFIX
from hearth.services.broker.connection import connect_nats, flush_ordered
from hearth.services.common.config import load_settings
from hearth.services.common.lifecycle import CommandRefused
from hearth.services.shard.compute import ShardCompute
from hearth.services.shard.server import ShardServer
from hearth.trust.community import Community
from tests.integration.tiny_shard_server import TinyShard, tiny_shard_server

REFUSAL = "tiny-0-1 is already served by another process"


async def test_a_second_process_under_a_served_shard_id_refuses_to_start(nats_server):
    settings = load_settings()
    async with tiny_shard_server(nats_server.url) as first:
        shard_events: list[str] = []

        async def on_event(msg) -> None:
            shard_events.append(json.loads(msg.data)["type"])

        await first.client.subscribe(f"{EVENTS_PREFIX}.shard.>", cb=on_event)
        await flush_ordered(first.client)
        twin_nc = await connect_nats(nats_server.url, name="twin-shard", settings=settings.nats)
        twin = ShardServer(twin_nc, ShardCompute(first.runner, "tiny-0-1", settings.shard), first.server.identity,
                           settings)
        twin._claim.nonce = "0" * 32  # the lowest nonce: a claim made later still ranks after the serving one
        try:
            with pytest.raises(CommandRefused, match=REFUSAL) as refused:
                await twin.start()
            assert "\n" not in str(refused.value)
            # The refused process stops as `hearth shard` does; the id it never held is not withdrawn.
            await twin.stop()
        finally:
            await twin_nc.close()
        assert first.server.active_streams == 0 and first.server._control_sub is not None
        await _answers_stat(first)
        assert "shard.withdrawn" not in shard_events
    # The first one gone (its subscription with it), the id is free again.
    async with tiny_shard_server(nats_server.url) as again:
        assert again.server._control_sub is not None


async def test_of_processes_starting_under_one_shard_id_at_once_exactly_one_serves(nats_server):
    settings = load_settings()
    async with tiny_shard_server(nats_server.url) as first:
        await first.server.stop()  # the id free again; its runner and identity serve the processes below
        for twin_count in (2, 3, 2, 3):
            connections = [await connect_nats(nats_server.url, name=f"twin-shard-{i}", settings=settings.nats)
                           for i in range(twin_count)]
            twins = [ShardServer(nc, ShardCompute(first.runner, "tiny-0-1", settings.shard), first.server.identity,
                                 settings) for nc in connections]
            try:
                outcomes = await asyncio.gather(*(twin.start() for twin in twins), return_exceptions=True)
                refusals = [outcome for outcome in outcomes if isinstance(outcome, CommandRefused)]
                assert outcomes.count(None) == 1 and len(refusals) == twin_count - 1, outcomes
                assert all(REFUSAL in str(refusal) and "\n" not in str(refusal) for refusal in refusals)
                # The winner goes on serving, and it alone answers on the id's control subject.
                assert len(await _stat_answers(first)) == 1
            finally:
                for twin in twins:
                    await twin.stop()
                for nc in connections:
                    await nc.close()


async def _answers_stat(shard: TinyShard) -> None:
    reply = await shard.client.request(shard.subject, StatShard().model_dump_json().encode(), timeout=5)
    assert ShardStat.model_validate_json(reply.data).shard_id == "tiny-0-1"


async def _stat_answers(shard: TinyShard) -> list[ShardStat]:
    """Every answer to one `stat` on the shard's control subject within a second."""
    inbox = shard.client.new_inbox()
    sub = await shard.client.subscribe(inbox)
    await shard.client.publish(shard.subject, StatShard().model_dump_json().encode(), reply=inbox)
    answers = []
    try:
        while True:
            answers.append(ShardStat.model_validate_json((await sub.next_msg(timeout=1.0)).data))
    except Exception:  # nats' TimeoutError: no more answers
        pass
    finally:
        await sub.unsubscribe()
    return answers


async def test_a_low_claim_not_signed_by_the_node_keeps_no_process_of_it_from_its_id(nats_server, tmp_path):
    # On a community mesh orchestrators may publish on every shard's control subject: a claim they send must not
    # count as a rival's, or one sending the lowest claim there would keep a restarting shard from its own id.
    community = Community.init(tmp_path / "community", "test-community")
    community.add("node0", "shard")
    settings = load_settings()
    signed = settings.model_copy(update={"nats": settings.nats.model_copy(update={
        "creds_file": community.directory / "keys" / "node0.nk", "roster_file": community.roster_path})})
    async with tiny_shard_server(nats_server.url) as first:
        await first.server.stop()  # restarted below, twice at once, under the node's key
        forging = asyncio.Event()

        async def forge() -> None:
            while not forging.is_set():
                await first.client.publish(first.subject, StatShard(claim="0" * 32).model_dump_json().encode())
                await asyncio.sleep(0.02)

        forger = asyncio.create_task(forge())
        connections = [await connect_nats(nats_server.url, name=f"node0-shard-{i}", settings=settings.nats)
                       for i in range(2)]
        twins = [ShardServer(nc, ShardCompute(first.runner, "tiny-0-1", settings.shard), first.server.identity,
                             signed) for nc in connections]
        try:
            outcomes = await asyncio.gather(*(twin.start() for twin in twins), return_exceptions=True)
            forging.set()
            await forger
            # The node's own processes still settle it between them: one serves, the other refuses.
            assert outcomes.count(None) == 1, outcomes
            assert [REFUSAL in str(outcome) for outcome in outcomes if outcome is not None] == [True]
            assert len(await _stat_answers(first)) == 1
        finally:
            forging.set()
            await forger
            for twin in twins:
                await twin.stop()
            for nc in connections:
                await nc.close()


class SlowToAnswer(ShardServer):
    """A process whose event loop is busy (or whose broker is loaded): it answers each control request only
    `answer_delay_s` after it arrives."""

    answer_delay_s = 0.0

    async def _answer_control(self, msg) -> None:
        await asyncio.sleep(self.answer_delay_s)
        await super()._answer_control(msg)


async def test_an_answer_later_than_the_newcomer_s_deadline_still_leaves_exactly_one_process_under_the_id(
        nats_server):
    # The process serving the id answers the newcomer's claim only after the newcomer stopped waiting for answers:
    # the newcomer keeps the id at first, and gives it up (silently, withdrawing nothing) once the late answer comes.
    settings = load_settings()
    async with tiny_shard_server(nats_server.url) as first:
        await first.server.stop()  # its runner and identity serve the two processes below
        shard_events: list[str] = []

        async def on_event(msg) -> None:
            shard_events.append(json.loads(msg.data)["type"])

        await first.client.subscribe(f"{EVENTS_PREFIX}.shard.>", cb=on_event)
        connections = [await connect_nats(nats_server.url, name=f"shard-{i}", settings=settings.nats)
                       for i in range(2)]
        serving = SlowToAnswer(connections[0], ShardCompute(first.runner, "tiny-0-1", settings.shard),
                               first.server.identity, settings)
        newcomer = ShardServer(connections[1], ShardCompute(first.runner, "tiny-0-1", settings.shard),
                               first.server.identity, settings)
        newcomer._claim.nonce = "0" * 32  # the lowest nonce: a later claim still ranks after the serving one
        try:
            await serving.start()
            serving.answer_delay_s = 6 * settings.transport.probe_timeout_s  # well after the newcomer's deadline
            await newcomer.start()  # heard nothing in time: keeps the id at first
            with pytest.raises(CommandRefused, match=REFUSAL) as refused:
                await newcomer.serve_until(asyncio.sleep(20 * serving.answer_delay_s))
            assert "\n" not in str(refused.value)
            await newcomer.stop()
            assert [serving._claim.kept, newcomer._claim.kept] == [True, False]
            serving.answer_delay_s = 0.0
            assert len(await _stat_answers(first)) == 1
            assert "shard.withdrawn" not in shard_events
        finally:
            for process in (serving, newcomer):
                await process.stop()
            for nc in connections:
                await nc.close()


async def test_a_process_cut_off_while_another_started_asks_again_on_reconnecting_and_exactly_one_keeps_the_id(
        nats_server):
    # While the serving process was cut off, the broker held nothing for it: a newcomer heard no answer and serves
    # too. Reconnected, the first one asks again; its claim ranks first, so the newcomer gives way.
    settings = load_settings()
    async with tiny_shard_server(nats_server.url) as first:
        await first.server.stop()
        connections = [await connect_nats(nats_server.url, name=f"shard-{i}", settings=settings.nats)
                       for i in range(2)]
        earlier, newcomer = (ShardServer(nc, ShardCompute(first.runner, "tiny-0-1", settings.shard),
                                         first.server.identity, settings) for nc in connections)
        try:
            await earlier.start()
            await earlier._control_sub.unsubscribe()  # cut off: what comes on its control subject is lost to it
            await flush_ordered(connections[0])
            await newcomer.start()
            earlier._control_sub = await connections[0].subscribe(first.subject, cb=earlier._on_control)
            earlier.request_readvertise()  # as on reconnecting
            with pytest.raises(CommandRefused, match=REFUSAL):
                await newcomer.serve_until(asyncio.sleep(30))
            assert [earlier._claim.kept, newcomer._claim.kept] == [True, False]
            await newcomer.stop()
            assert len(await _stat_answers(first)) == 1
        finally:
            for process in (earlier, newcomer):
                await process.stop()
            for nc in connections:
                await nc.close()
