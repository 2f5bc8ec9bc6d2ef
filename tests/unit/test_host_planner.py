"""`hearth host` choosing its layers from a read model (filled by the projection): coverage as routing sees it, the
range that fits the budget and most improves coverage, and when (not) to move."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from sqlalchemy.orm import sessionmaker

from hearth.events.models import ShardWithdrawn
from hearth.readmodels.batch_rows import epoch_s
from hearth.services.common.config import HearthSettings
from hearth.services.host.coverage import CoverageReader
from hearth.services.host.planner import LayerRange, better_range, choose_range, widest_fit
from hearth.services.orchestrator.router import ShardRouter
from tests.readmodel_helpers import (
    MODEL_ID, T0, WEIGHTS_SHA, LogBuilder, advertised, apply_all, at, heartbeat, migrated_engine,
)

LAYERS = 8
LAYER_BYTES = [100] * LAYERS
TWO_LAYERS = 250  # a budget that holds two layers, not three


class Mesh:
    def __init__(self, engine, layers: int = LAYERS) -> None:
        self.engine, self.log, self.layers = engine, LogBuilder(), layers
        self.now = epoch_s(T0) + 5.0

    def add(self, lo: int, hi: int, node: str, **fields) -> str:
        event = advertised(lo, hi, node, total=self.layers, **fields)
        apply_all(self.engine, [self.log.stored(event)])
        return event.shard_id

    def withdraw(self, shard_id: str, node: str, reason: str = "shutdown", t: float = 0.0) -> None:
        apply_all(self.engine, [self.log.stored(ShardWithdrawn(shard_id=shard_id, node_id=node, reason=reason,
                                                               occurred_at=at(t)))])

    def coverage(self) -> CoverageReader:
        router = ShardRouter(sessionmaker(self.engine), health_timeout_s=30.0, allow_self_as_shard=True,
                             self_node_id="me", clock=lambda: self.now)
        return CoverageReader(router, model_id=MODEL_ID, weights_sha256=WEIGHTS_SHA, total_layers=self.layers)


def host_settings(**host) -> HearthSettings:
    """Settings with these `[research.distributed_inference.host]` fields (quick holds and checks)."""
    settings = HearthSettings()
    distributed = settings.research.distributed_inference
    research = settings.research.model_copy(update={"distributed_inference": distributed.model_copy(
        update={"host": distributed.host.model_copy(update=host)})})
    return settings.model_copy(update={"research": research})


@pytest.fixture
def mesh(tmp_path):
    engine = migrated_engine(tmp_path / "host.db")
    yield Mesh(engine)
    engine.dispose()


async def test_replicas_count_live_shards_with_our_weights_only(mesh):
    mesh.add(0, 3, "a")
    mesh.add(2, 5, "b")
    mesh.add(6, 7, "c", weights_sha256="cd" * 32)  # other weights: not ours to count
    gone = mesh.add(6, 7, "d")
    mesh.withdraw(gone, "d")
    assert await mesh.coverage().replicas() == [1, 1, 2, 2, 1, 1, 0, 0]
    # This host's own shard is left out when it asks whether to move.
    assert await mesh.coverage().replicas(leave_out=mesh.add(0, 1, "me")) == [1, 1, 2, 2, 1, 1, 0, 0]
    mesh.now += 200.0  # every advertisement expired (ttl 120 s)
    assert await mesh.coverage().replicas() == [0] * LAYERS


async def test_hosts_joining_one_by_one_cover_the_model_least_replicated_first(mesh):
    chosen = []
    for node in "abcd":
        layer_range = choose_range(await mesh.coverage().replicas(), LAYER_BYTES, TWO_LAYERS)
        chosen.append(str(layer_range))
        mesh.add(layer_range.lo, layer_range.hi, node)
    assert chosen == ["0-1", "2-3", "4-5", "6-7"]
    # Everything held once: a fifth host adds a second replica of two layers (the lowest, all else equal).
    assert choose_range(await mesh.coverage().replicas(), LAYER_BYTES, TWO_LAYERS) == LayerRange(0, 1)


async def test_a_newcomer_fills_the_hole_first(mesh):
    mesh.add(0, 3, "a")
    mesh.add(6, 7, "b")
    assert choose_range(await mesh.coverage().replicas(), LAYER_BYTES, TWO_LAYERS) == LayerRange(4, 5)


async def test_one_nodes_many_adverts_of_the_same_layers_count_once(mesh):
    """A member may advertise any number of shards: before, three of its adverts of layers 4-7 counted as three
    replicas, and honest hosts all chose 0-3, leaving 4-7 to adverts alone."""
    mesh.add(0, 7, "a")
    for lo, hi in ((4, 7), (4, 6), (5, 7)):
        mesh.add(lo, hi, "many")
    replicas = await mesh.coverage().replicas()
    assert replicas == [1, 1, 1, 1, 2, 2, 2, 2]
    assert choose_range(replicas, LAYER_BYTES, TWO_LAYERS) == LayerRange(0, 1)


def test_the_budget_decides_how_many_layers():
    assert widest_fit(0, LAYER_BYTES, 99) is None
    assert widest_fit(0, LAYER_BYTES, 300) == 2
    assert widest_fit(7, LAYER_BYTES, 300) == 7
    assert choose_range([0] * LAYERS, LAYER_BYTES, 50) is None
    # Unequal layers: the widest range that fits from each start.
    assert choose_range([1, 1, 0, 0, 1], [100, 100, 100, 300, 100], 250) == LayerRange(1, 2)
    assert choose_range([1, 1, 0, 0, 1], [100, 100, 100, 100, 100], 250) == LayerRange(2, 3)


def test_a_host_moves_only_to_fill_a_hole_and_never_drops_a_last_replica():
    mine = LayerRange(0, 1)
    # Balanced mesh, no hole: stay.
    assert better_range(mine, [1, 1, 1, 1, 1, 1, 1, 1], LAYER_BYTES, TWO_LAYERS) is None
    # A hole at 4-5, and layers 0-1 held elsewhere: move there.
    assert better_range(mine, [1, 1, 1, 1, 0, 0, 1, 1], LAYER_BYTES, TWO_LAYERS) == LayerRange(4, 5)
    # A hole, but this host holds the only replica of layer 1: stay (moving would open another hole).
    assert better_range(mine, [1, 0, 1, 1, 0, 0, 1, 1], LAYER_BYTES, TWO_LAYERS) is None


async def test_hosts_holding_the_same_layers_take_turns_to_move_in_shard_id_order(mesh):
    first, second = mesh.add(0, 1, "a"), mesh.add(0, 1, "d")
    third = mesh.add(1, 2, "c")  # shares layer 1 with them (and its shard id sorts after theirs)
    mesh.add(6, 7, "b")  # holds none of their layers
    mesh.add(0, 1, "e", weights_sha256="cd" * 32)  # other weights
    coverage = mesh.coverage()
    assert await coverage.turn(LayerRange(0, 1), first) == 0
    assert await coverage.turn(LayerRange(0, 1), second) == 1
    assert await coverage.turn(LayerRange(1, 2), third) == 2
    mesh.withdraw(first, "a")  # gone: the others' turns come earlier
    assert await coverage.turn(LayerRange(0, 1), second) == 0
    assert await coverage.turn(LayerRange(1, 2), third) == 1


async def test_a_host_waits_one_hold_more_per_host_before_it_in_turn(mesh):
    from hearth.services.host.main import wait_for_hole

    settings = host_settings(rebalance_hold_s=0.2, rebalance_check_interval_s=0.02)
    mesh.add(0, 1, "a")
    mine = mesh.add(0, 1, "d")
    for lo in (2, 6):
        mesh.add(lo, lo + 1, "x" + str(lo))  # 4-5 is the hole
    loop = asyncio.get_running_loop()
    started = loop.time()
    target = await asyncio.wait_for(wait_for_hole(mesh.coverage(), LayerRange(0, 1), mine, LAYER_BYTES, TWO_LAYERS,
                                                  settings), timeout=5)
    assert target == LayerRange(4, 5)
    assert loop.time() - started >= 2 * 0.2  # second in turn: two holds (the first host's move would show meanwhile)


async def test_a_restarted_host_leaves_out_its_own_earlier_shard_that_no_longer_answers(mesh):
    """A host restarted after a crash finds its old advert still alive (until the health timeout): counted, it
    passed for a replica of the host's old layers, which the host then left to it and chose others, leaving its old
    layers held by nobody. Another process of the same node that answers still counts."""
    mesh.add(0, 1, "a")
    mesh.add(2, 3, "b")
    crashed = mesh.add(4, 5, "me")  # the host's own shard before the crash
    mesh.add(6, 7, "me")  # another process of this node, serving on

    async def answers(shard) -> bool:
        return shard.shard_id != crashed

    coverage = mesh.coverage()
    left_out = await coverage.unanswering_shards_of("me", answers)
    assert left_out == {crashed}
    replicas = await coverage.replicas(leave_out=left_out)
    assert replicas == [1, 1, 1, 1, 0, 0, 1, 1]
    assert choose_range(replicas, LAYER_BYTES, TWO_LAYERS) == LayerRange(4, 5)


def test_a_host_with_spare_budget_widens_over_a_hole_next_to_layers_only_it_holds():
    """A host at the model's end serves fewer layers than its budget holds. When the host before it left, it stayed:
    its layers had no other replica, and a move was refused whatever the range, even one keeping all of them."""
    mine = LayerRange(6, 7)  # a budget of three layers: 5-7 keeps 6-7 and covers layer 5 of the hole
    assert better_range(mine, [1, 1, 1, 0, 0, 0, 0, 0], LAYER_BYTES, 300) == LayerRange(5, 7)
    # A range that drops one of its last replicas is still never taken, however many holes it covers.
    assert better_range(LayerRange(0, 2), [0, 1, 1, 0, 0, 0, 1, 1], LAYER_BYTES, 300) is None
    # Layers held elsewhere too may be dropped on the way (6 is), the last replica of 7 is kept.
    assert better_range(LayerRange(6, 7), [1, 1, 1, 1, 1, 0, 1, 0], LAYER_BYTES, 300) == LayerRange(5, 7)


async def test_hosts_that_started_together_on_the_same_layers_spread_out_one_move_at_a_time(mesh):
    """Three hosts that chose 0-1 at the same moment (none saw the others): each watches for holes; a move is
    carried out in the mesh (withdrawn, then advertised on its new range) as soon as it is decided. They end on
    three different ranges, covering the model, and nobody drops a last replica on the way."""
    from hearth.services.host.main import wait_for_hole

    settings = host_settings(rebalance_hold_s=0.1, rebalance_check_interval_s=0.01)
    layer_bytes, budget = [100] * 6, 250
    six = Mesh(mesh.engine, layers=6)
    held = {node: (LayerRange(0, 1), six.add(0, 1, node)) for node in "abc"}

    async def host(node: str) -> None:
        while True:
            current, shard_id = held[node]
            target = await wait_for_hole(six.coverage(), current, shard_id, layer_bytes, budget, settings)
            six.withdraw(shard_id, node, reason="moved")
            held[node] = (target, six.add(target.lo, target.hi, node))

    def spread_out() -> bool:
        return sorted(str(current) for current, _ in held.values()) == ["0-1", "2-3", "4-5"]

    await run_for(30.0, *(host(node) for node in "abc"), until=spread_out)
    assert sorted(str(current) for current, _ in held.values()) == ["0-1", "2-3", "4-5"]


async def run_for(seconds: float, *coroutines, until: Callable[[], bool] | None = None) -> None:
    """Run the hosts for `seconds`, or until `until()` holds (checked every 10 ms), whichever comes first: a loaded
    machine gets as long as it needs, an idle one stops as soon as the mesh has settled."""
    tasks = [asyncio.create_task(coroutine) for coroutine in coroutines]
    try:
        deadline = asyncio.get_running_loop().time() + seconds
        while asyncio.get_running_loop().time() < deadline and not (until is not None and until()):
            await asyncio.sleep(0.01)
            if any(task.done() for task in tasks):
                break
        for task in tasks:
            if task.done():
                task.result()  # a host that failed fails the test
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_host_waits_for_a_move_under_way_rather_than_following_it_into_the_same_hole(mesh):
    """A move withdraws the old range, then loads the new one (fetching it, perhaps: minutes), and only then
    advertises it. Before, the next host in turn saw the hole still open meanwhile and moved into it too: with three
    hosts on 0-1, two ended on 2-3 and one of them moved again. A move under way (withdrawn `moved`, its node not
    advertised since) now holds the others' decisions until it has landed."""
    from hearth.services.host.main import wait_for_hole

    # Turns a hold apart: 0.8 s, so that an event loop stalled on a loaded machine does not wake two hosts whose
    # turns have both passed in the same pass, the later one deciding on a read from before the earlier one's move.
    settings = host_settings(rebalance_hold_s=0.8, rebalance_check_interval_s=0.01)
    six = Mesh(mesh.engine, layers=6)
    held = {node: (LayerRange(0, 1), six.add(0, 1, node)) for node in "abc"}
    moves: list[str] = []

    async def host(node: str) -> None:
        while True:
            current, shard_id = held[node]
            target = await wait_for_hole(six.coverage(), current, shard_id, [100] * 6, 250, settings)
            moves.append(f"{node}: {current} -> {target}")
            six.withdraw(shard_id, node, reason="moved")
            await asyncio.sleep(4.0)  # loading the new range: far longer than the holds, on a loaded machine too
            held[node] = (target, six.add(target.lo, target.hi, node))

    await run_for(16.0, *(host(node) for node in "abc"))
    assert sorted(str(current) for current, _ in held.values()) == ["0-1", "2-3", "4-5"]
    assert len(moves) == 2, moves


async def test_a_move_is_under_way_until_its_node_advertises_another_range_or_says_it_will_not_land(mesh):
    coverage = mesh.coverage()  # its clock reads 5 s after the log's start
    left = mesh.add(0, 1, "a")
    mesh.add(2, 3, "b")
    assert not await coverage.move_under_way(600)
    mesh.withdraw(left, "a", reason="moved", t=1)
    assert await coverage.move_under_way(600)
    assert not await coverage.move_under_way(1)  # withdrawn 4 s ago: waited for long enough
    mesh.add(4, 5, "a", quantization="int8", t=2)  # another scheme's range is not where this move lands
    assert await coverage.move_under_way(600)
    landed = mesh.add(4, 5, "a", t=2)
    assert not await coverage.move_under_way(600)
    mesh.withdraw(landed, "a", reason="moved", t=3)  # moving on again: under way until it says it will not land
    assert await coverage.move_under_way(600)
    mesh.withdraw(landed, "a", reason="shutdown", t=4)
    assert not await coverage.move_under_way(600)


async def test_a_move_is_under_way_only_while_its_host_is_heard_from(mesh):
    """A mover killed mid-move (SIGKILL: no withdrawal `shutdown` follows) held the others back for the whole
    `move_wait_max_s`; its heartbeats of the range it left go on while it moves, and the move counts only while they
    do (the health timeout, 30 s here), as a killed host's own range does."""
    coverage = mesh.coverage()
    left = mesh.add(0, 1, "a")
    mesh.withdraw(left, "a", reason="moved", t=1)
    mesh.now = epoch_s(T0) + 30
    assert await coverage.move_under_way(600)  # withdrawn 29 s ago: within the health timeout
    mesh.now = epoch_s(T0) + 40
    assert not await coverage.move_under_way(600)  # silent 39 s: killed, it will not land
    apply_all(mesh.engine, [mesh.log.stored(heartbeat(left, t=38, node="a"))])  # draining or loading: alive
    assert await coverage.move_under_way(600)
    mesh.now = epoch_s(T0) + 70
    assert not await coverage.move_under_way(600)


async def test_a_host_that_looked_gone_and_comes_back_makes_nobody_move_back(mesh):
    """Adverts and heartbeats that arrive late: b's range looks dead (heard from 45 s ago, past the 30 s health
    timeout), a host holding duplicated layers fills its hole, then b is heard from again. Its layers are held twice
    now and there is no hole: nobody moves again (no flapping), whichever host looks."""
    from hearth.services.host.main import wait_for_hole

    settings = host_settings(rebalance_hold_s=0.05, rebalance_check_interval_s=0.01)
    six = Mesh(mesh.engine, layers=6)
    held = {"a": six.add(0, 1, "a"), "c": six.add(0, 1, "c"), "d": six.add(4, 5, "d")}
    late = six.add(2, 3, "b", t=-40)
    target = await asyncio.wait_for(wait_for_hole(six.coverage(), LayerRange(0, 1), held["a"], [100] * 6, 250,
                                                  settings), timeout=5)
    assert target == LayerRange(2, 3)
    six.withdraw(held["a"], "a", reason="moved")
    held["a"] = six.add(2, 3, "a")
    assert six.add(2, 3, "b") == late  # heard from again
    ranges = {"a": LayerRange(2, 3), "c": LayerRange(0, 1), "d": LayerRange(4, 5), "b": LayerRange(2, 3)}
    held["b"] = late
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*(
            wait_for_hole(six.coverage(), ranges[node], shard_id, [100] * 6, 250, settings)
            for node, shard_id in held.items())), timeout=1)


async def test_layers_served_in_another_scheme_are_named_apart_and_do_not_count(mesh, caplog):
    """A household whose hosts were started with different --quantize formed a pipeline per scheme, neither whole,
    and no host said why its coverage looked empty while the mesh served the model."""
    import logging

    from hearth.services.host.coverage import warn_of_other_schemes

    mesh.add(0, 3, "a", quantization="int8")
    mesh.add(4, 7, "b", quantization="int8")
    mesh.add(0, 1, "c")
    coverage = mesh.coverage()
    assert await coverage.replicas() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert await coverage.other_schemes() == {"int8": [1] * LAYERS}
    with caplog.at_level(logging.WARNING, logger="hearth.services.host.coverage"):
        await warn_of_other_schemes(coverage, "me")
    assert caplog.messages == [f"host me: the mesh also serves {MODEL_ID} in int8 (0-7 x1), which this host's none "
                               "pipelines cannot use: start every host of the model with the same --quantize to pool "
                               "their layers"]
