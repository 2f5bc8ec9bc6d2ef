"""Unit tests of FairQueue (hearth/services/orchestrator/queue.py): round-robin by caller, per-caller limit, the bound,
positions, calls that leave while waiting or whose client went unheard by their turn, and each caller's shares
(running places below the total, its part of the queue, room taken back from the caller waiting with the most when
the queue is full)."""

from __future__ import annotations

import asyncio

import pytest

from hearth.services.orchestrator.queue import FairQueue, LeftQueue, Overloaded


class Recorder:
    """Runs calls through a queue; each holds its place until released, and records its start order and the
    positions it was told."""

    def __init__(self, queue: FairQueue) -> None:
        self.queue = queue
        self.started: list[str] = []
        self.positions: dict[str, list[int]] = {}
        self._release: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    def submit(self, name: str, caller: str | None, gone: asyncio.Event | None = None,
               client=None) -> asyncio.Task:
        self._release[name] = asyncio.Event()

        async def told(position: int, queued: int) -> None:
            self.positions.setdefault(name, []).append(position)

        async def call() -> str:
            async with self.queue.place(caller, told, gone, client=client):
                self.started.append(name)
                await self._release[name].wait()
            return name

        task = asyncio.create_task(call())
        self.tasks[name] = task
        return task

    async def finish(self, name: str) -> None:
        self._release[name].set()
        await self.tasks[name]
        await settle()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def fair_queue(**limits) -> FairQueue:
    return FairQueue(**{"max_running": 1, "max_per_caller": 10, "max_queued": 10, "max_queued_per_caller": 10,
                        "retry_after_s": 3.0, **limits})


async def test_waiting_calls_start_round_robin_by_caller():
    recorder = Recorder(fair_queue())
    recorder.submit("running", "alice")
    for index in range(3):
        recorder.submit(f"alice-{index}", "alice")
    await settle()
    recorder.submit("bob-0", "bob")
    recorder.submit("bob-1", "bob")
    recorder.submit("carol-0", "carol")
    await settle()
    # Told their place in start order: alice's burst does not hold bob's and carol's first calls back.
    assert {name: told[-1] for name, told in recorder.positions.items()} == {
        "alice-0": 1, "bob-0": 2, "carol-0": 3, "alice-1": 4, "bob-1": 5, "alice-2": 6}
    for name in ["running", "alice-0", "bob-0", "carol-0", "alice-1", "bob-1"]:
        await recorder.finish(name)
    assert recorder.started == ["running", "alice-0", "bob-0", "carol-0", "alice-1", "bob-1", "alice-2"]
    # Told again at every change: back as other callers' first calls came in ahead, then up as calls started.
    assert recorder.positions["alice-2"] == [3, 4, 5, 6, 5, 4, 3, 2, 1]
    await recorder.finish("alice-2")
    assert recorder.queue.running == 0 and recorder.queue.queued == 0


async def test_a_caller_at_its_limit_waits_while_another_caller_starts():
    recorder = Recorder(fair_queue(max_running=4, max_per_caller=2))
    for index in range(3):
        recorder.submit(f"alice-{index}", "alice")
    await settle()
    assert recorder.started == ["alice-0", "alice-1"]
    assert recorder.positions == {"alice-2": [1]}
    recorder.submit("bob-0", "bob")
    await settle()
    assert recorder.started[-1] == "bob-0"  # room overall, and bob is under his own limit
    await recorder.finish("alice-0")
    assert recorder.started[-1] == "alice-2"
    for name in ["alice-1", "alice-2", "bob-0"]:
        await recorder.finish(name)


async def test_beyond_the_bound_a_call_is_overloaded_with_retry_after():
    recorder = Recorder(fair_queue(max_queued=2, retry_after_s=7.5))
    recorder.submit("running", None)
    recorder.submit("queued-1", None)
    recorder.submit("queued-2", None)
    await settle()
    refused = recorder.submit("refused", None)
    with pytest.raises(Overloaded) as error:
        await refused
    assert error.value.retry_after_s == 7.5
    assert recorder.queue.queued == 2
    for name in ["running", "queued-1", "queued-2"]:
        await recorder.finish(name)


async def test_a_call_whose_client_left_or_was_cancelled_leaves_the_queue():
    recorder = Recorder(fair_queue())
    gone = asyncio.Event()
    recorder.submit("running", "a")
    leaving = recorder.submit("leaving", "b", gone)
    cancelled = recorder.submit("cancelled", "c")
    recorder.submit("next", "d")
    await settle()
    assert recorder.positions["next"][-1] == 3
    gone.set()
    cancelled.cancel()
    with pytest.raises(LeftQueue):
        await leaving
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await settle()
    assert recorder.positions["next"][-1] == 1
    await recorder.finish("running")
    assert recorder.started == ["running", "next"]
    await recorder.finish("next")
    assert recorder.queue.running == 0 and recorder.queue.queued == 0


async def test_a_member_never_holds_every_running_place_so_another_starts_at_once():
    recorder = Recorder(fair_queue(max_running=3, max_per_caller=5))
    for index in range(4):
        recorder.submit(f"alice-{index}", "alice")
    await settle()
    # Her limit (5) is above the total (3): she still runs one fewer than the total.
    assert recorder.started == ["alice-0", "alice-1"]
    recorder.submit("bob-0", "bob")
    await settle()
    assert recorder.started[-1] == "bob-0" and "bob-0" not in recorder.positions
    for name in ["alice-0", "alice-1", "alice-2", "alice-3", "bob-0"]:
        await recorder.finish(name)
    assert recorder.queue.running == 0 and recorder.queue.queued == 0


async def test_a_lone_place_and_unsigned_callers_are_not_held_back_by_the_member_share():
    lone = Recorder(fair_queue(max_running=1, max_per_caller=5))
    lone.submit("alice-0", "alice")
    await settle()
    assert lone.started == ["alice-0"]
    await lone.finish("alice-0")
    # An open mesh cannot tell its callers apart: their one lane may use every place and the whole queue.
    open_mesh = Recorder(fair_queue(max_running=2, max_per_caller=5, max_queued=3, max_queued_per_caller=1))
    for index in range(5):
        open_mesh.submit(f"anyone-{index}", None)
    await settle()
    assert open_mesh.started == ["anyone-0", "anyone-1"] and open_mesh.queue.queued == 3
    for index in range(5):
        await open_mesh.finish(f"anyone-{index}")


async def test_a_caller_beyond_its_queue_share_is_overloaded_while_another_still_gets_in():
    recorder = Recorder(fair_queue(max_queued=10, max_queued_per_caller=2, retry_after_s=4.0))
    recorder.submit("running", "alice")
    recorder.submit("alice-1", "alice")
    recorder.submit("alice-2", "alice")
    await settle()
    refused = recorder.submit("alice-3", "alice")
    with pytest.raises(Overloaded, match="max_queued_per_caller") as error:
        await refused
    assert error.value.retry_after_s == 4.0
    recorder.submit("bob-1", "bob")
    await settle()
    assert recorder.positions["bob-1"][-1] == 2 and recorder.queue.queued == 3
    for name in ["running", "alice-1", "bob-1", "alice-2"]:
        await recorder.finish(name)
    assert recorder.started == ["running", "alice-1", "bob-1", "alice-2"]


async def test_a_full_share_is_told_before_the_call_is_placed_and_only_for_that_member():
    recorder = Recorder(fair_queue(max_running=2, max_queued_per_caller=1))
    queue = recorder.queue
    assert queue.share_refusal("alice") is None  # a place is free
    recorder.submit("running", "alice")
    await settle()
    assert queue.share_refusal("alice") is None  # may not run a second (her share is 1 of 2) but may wait
    recorder.submit("alice-1", "alice")
    await settle()
    refusal = queue.share_refusal("alice")
    assert isinstance(refusal, Overloaded) and "max_queued_per_caller" in str(refusal)
    assert refusal.retry_after_s == 3.0
    assert queue.share_refusal("bob") is None and queue.share_refusal(None) is None
    assert queue.queued == 1  # telling placed nothing
    for name in ["running", "alice-1"]:
        await recorder.finish(name)


async def test_when_the_queue_is_full_the_caller_waiting_with_the_most_gives_up_its_newest_place():
    recorder = Recorder(fair_queue(max_queued=3, retry_after_s=2.0))
    recorder.submit("running", "alice")
    for index in range(1, 4):
        recorder.submit(f"alice-{index}", "alice")
    await settle()
    recorder.submit("bob-1", "bob")
    await settle()
    # bob had nothing waiting: alice's newest call is refused so that bob's waits in its place.
    with pytest.raises(Overloaded, match="max_queued_requests") as error:
        await recorder.tasks["alice-3"]
    assert error.value.retry_after_s == 2.0
    assert recorder.positions["bob-1"][-1] == 2 and recorder.queue.queued == 3
    recorder.submit("carol-1", "carol")
    await settle()
    # Now alice waits with 2 and carol with none: alice gives up another.
    with pytest.raises(Overloaded):
        await recorder.tasks["alice-2"]
    # Every caller waits with one: a newcomer is refused, nobody is displaced.
    with pytest.raises(Overloaded, match="3 calls are already waiting"):
        await recorder.submit("dave-1", "dave")
    assert recorder.queue.queued == 3
    for name in ["running", "alice-1", "bob-1", "carol-1"]:
        await recorder.finish(name)
    assert recorder.started == ["running", "alice-1", "bob-1", "carol-1"]
    assert recorder.queue.running == 0 and recorder.queue.queued == 0


async def hold(queue: FairQueue, caller: str | None, pipelines: int, started: list, release: asyncio.Event) -> None:
    async with queue.place(caller, pipelines=pipelines) as admission:
        started.append((caller, admission.places))
        await release.wait()


async def test_a_call_of_several_pipelines_holds_a_place_for_each_within_its_callers_share():
    queue = fair_queue(max_running=4, max_per_caller=10)
    started: list = []
    release = asyncio.Event()
    tasks = [asyncio.create_task(hold(queue, "alice", 8, started, release))]  # n = 8: her share is 3 of 4
    await settle()
    assert started == [("alice", 3)] and queue.running == 3
    tasks.append(asyncio.create_task(hold(queue, "bob", 2, started, release)))
    await settle()
    assert started == [("alice", 3)] and queue.queued == 1  # one place is free, bob's call needs two
    release.set()
    await asyncio.gather(*tasks)
    assert started == [("alice", 3), ("bob", 2)] and queue.running == 0


async def test_places_freed_one_by_one_are_kept_for_the_call_waiting_for_several():
    queue = fair_queue(max_running=4, max_per_caller=10)
    started: list = []
    releases = {name: asyncio.Event() for name in ("bob-0", "bob-1", "alice", "carol")}
    bob = [asyncio.create_task(hold(queue, "bob", 1, started, releases[f"bob-{i}"])) for i in range(2)]
    await settle()
    alice = asyncio.create_task(hold(queue, "alice", 3, started, releases["alice"]))
    await settle()
    carol = asyncio.create_task(hold(queue, "carol", 1, started, releases["carol"]))
    await settle()
    # Two places are free, but alice's call waits for three first: carol's single call does not take them.
    assert started == [("bob", 1), ("bob", 1)] and queue.queued == 2
    releases["bob-0"].set()
    await bob[0]
    await settle()
    assert started[-1] == ("alice", 3) and queue.running == 4 and queue.queued == 1
    releases["alice"].set()
    await alice
    await settle()
    assert started[-1] == ("carol", 1)
    for event in releases.values():
        event.set()
    await asyncio.gather(*bob, carol)
    assert queue.running == 0 and queue.queued == 0


async def test_an_unsigned_call_never_waits_for_more_places_than_there_are():
    queue = fair_queue(max_running=2, max_per_caller=4)
    started: list = []
    release = asyncio.Event()
    release.set()
    await asyncio.wait_for(hold(queue, None, 8, started, release), timeout=5)
    assert started == [(None, 2)]


class ClientUnheardOnce:
    """A waited call's client that nobody hears at its turn, then listens again once `back` is set."""

    def __init__(self) -> None:
        self.back = asyncio.Event()
        self.asked = 0

    async def unheard(self) -> bool:
        self.asked += 1
        return self.asked == 1

    async def back_or_gone(self) -> bool:
        await self.back.wait()
        return True


async def test_a_call_whose_client_is_unheard_at_its_turn_lets_the_next_run_and_waits_first_in_its_lane():
    recorder = Recorder(fair_queue())
    client = ClientUnheardOnce()
    recorder.submit("running", "alice")
    await settle()
    recorder.submit("unheard", "bob", client=client)
    recorder.submit("bob-after", "bob")
    recorder.submit("carol", "carol")
    await settle()
    await recorder.finish("running")
    assert recorder.started == ["running", "carol"]  # the unheard call's place went on at once
    client.back.set()
    await settle()
    await recorder.finish("carol")
    await recorder.finish("unheard")  # back, it went before its caller's later call
    await recorder.finish("bob-after")
    assert recorder.started == ["running", "carol", "unheard", "bob-after"]
    assert recorder.queue.running == 0 and recorder.queue.queued == 0
