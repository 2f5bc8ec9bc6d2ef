"""FairQueue: admission of calls to run, in a bounded queue served round-robin by caller.

A call starts at once when the orchestrator runs fewer than `max_running` calls and its caller fewer than its
running share; otherwise it waits in its caller's lane and is told its place (`on_position`), and again
whenever that place changes. Lanes are served in turn: one call of each caller with something runnable, then
the next round, so one caller's burst never holds back another caller's single call. A call running several pipelines
(`n` choices) holds a place for each, up to its caller's running share; places that free while the call next in turn
needs more of them than are free are kept for it, so calls needing one place cannot take each as it frees. A waited
call whose client is unheard when its turn comes (`WaitingClient.unheard`: it may have left moments ago) gives its
places to the next call and runs nothing: it leaves once the client is gone, or waits again first in its lane once
the client listens again.

Shares, so that one member can never lock the others out: a caller runs at most `max_per_caller` calls and
never every running place (at most `max_running - 1` when there are several), and waits with at most
`max_queued_per_caller` calls; one more is refused (`Overloaded`), never queued. A member's calls are counted from
their arrival (`arrive`, `leave`): at most its running share plus its share of the queue are held here at once, those
not queued yet (a head loading) included. When all `max_queued` places are taken, a caller with fewer waiting
calls still gets in: the newest call of the caller waiting with the most is refused in its stead. The running share
is derived rather than validated because its two settings live in different sections with their own defaults, and
either may be set alone.

Callers are roster names on a community mesh; every unsigned caller (an open mesh, where nothing tells callers
apart) shares one lane, bounded by `max_per_caller` and the whole queue only.
The queue is pure asyncio state (no I/O of its own): the service wires the position callback and the waiting client
to the call's client stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from hearth.services.common.metrics import gauge, histogram

queued_requests_gauge = gauge("hearth_queued_requests", "Calls waiting in this orchestrator's queue for room to run")
queue_wait_seconds = histogram("hearth_queue_wait_seconds", "How long each call waited in the queue before it started",
                               buckets=(0.005, 0.05, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))

ANONYMOUS_CALLER = ""
PositionCallback = Callable[[int, int], Awaitable[None]]


class WaitingClient(Protocol):
    """What the queue asks of a waited call's client when its turn comes (ClientStream)."""

    async def unheard(self) -> bool:
        """Whether nobody listens on the client's inbox now."""

    async def back_or_gone(self) -> bool:
        """After `unheard`: True once the client listens again, False once it is gone."""


class LeftQueue(Exception):
    """The call's client went away while it waited: it leaves the queue without running."""


class Overloaded(Exception):
    """The queue, or the caller's share of it, is full: the call is refused and its client should come back
    after `retry_after_s`."""

    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(f"{reason}; retry after {retry_after_s:g} s")
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class _Waiter:
    caller: str
    on_position: PositionCallback | None
    places: int
    admitted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    position: int = 0


@dataclass
class Admission:
    """A call's places among the running ones (`places`: one per pipeline it may run at once, its `n` choices'); how
    long it waited for them."""

    caller: str
    queue_wait_s: float
    places: int


class FairQueue:
    """Counts running calls per caller and hands free places to waiting calls, round-robin by caller."""

    def __init__(self, *, max_running: int, max_per_caller: int, max_queued: int, max_queued_per_caller: int,
                 retry_after_s: float) -> None:
        self.max_running = max_running
        self.max_per_caller = max_per_caller
        # A named caller's running share: below the total whenever there is more than one place.
        self.member_running_share = min(max_per_caller, max(max_running - 1, 1))
        self.max_queued = max_queued
        self.max_queued_per_caller = max_queued_per_caller
        self.retry_after_s = retry_after_s
        self.running = 0
        self._running_by_caller: dict[str, int] = {}
        # member -> its calls held from arrival to end (running, waiting, or not yet queued: a head loading).
        self._arrived: dict[str, int] = {}
        # caller -> its waiting calls; the order of the keys is the round-robin order (next to serve first).
        self._lanes: OrderedDict[str, deque[_Waiter]] = OrderedDict()
        self._position_tasks: set[asyncio.Task] = set()

    @property
    def queued(self) -> int:
        return sum(len(lane) for lane in self._lanes.values())

    @contextlib.asynccontextmanager
    async def place(self, caller: str | None, on_position: PositionCallback | None = None,
                    client_gone: asyncio.Event | None = None, pipelines: int = 1,
                    client: WaitingClient | None = None) -> AsyncIterator[Admission]:
        """Hold running places for the body's duration, one per pipeline the call runs at once (`pipelines`, at
        most its caller's running share: Admission.places says how many), waiting for them first when needed;
        Overloaded when the queue or the caller's share of it is full (or later, while waiting, when another
        caller's call took its place), LeftQueue when `client_gone` is set while waiting, or when `client` went
        unheard by the call's turn and is gone (see `_unheard_at_turn`). A call cancelled while waiting leaves the
        queue."""
        lane_key = caller or ANONYMOUS_CALLER
        places = max(1, min(pipelines, self.running_share(lane_key), self.max_running))
        started = time.monotonic()
        # At rest no waiting call could start (each change dispatches) but one waiting for more places than are
        # free, which they are kept for: a call that can start now jumps nobody's turn.
        if self._can_start(lane_key, places) and self._waiting_for_room() is None:
            self._start(lane_key, places)
        else:
            await self._wait(lane_key, on_position, client_gone, places)
            while client is not None and await self._unheard_at_turn(client, lane_key, places):
                await self._wait(lane_key, on_position, client_gone, places, returning=True)
        waited_s = time.monotonic() - started
        queue_wait_seconds.observe(waited_s)
        try:
            yield Admission(lane_key, waited_s, places)
        finally:
            self._finish(lane_key, places)

    def arrive(self, caller: str | None) -> Overloaded | None:
        """Count a member's call from its arrival until `leave`, or the refusal when its share of the queue is full
        or its calls held here (running, waiting, or before the queue, as while a head loads) fill its running share
        and its share of the queue: checked before any work on the call, so that a flooding member's surplus costs
        none. Unsigned callers are bounded by the whole queue only."""
        if not caller:
            return None
        refusal = self.share_refusal(caller)
        held = self._arrived.get(caller, 0)
        if refusal is None and held >= self.member_running_share + self.max_queued_per_caller:
            refusal = Overloaded(f"{held} calls of this caller are already on this orchestrator, running, waiting "
                                 f"or arriving (max_streams_per_caller + max_queued_per_caller)", self.retry_after_s)
        if refusal is None:
            self._arrived[caller] = held + 1
        return refusal

    def leave(self, caller: str | None) -> None:
        """A call counted by `arrive` ended, however it ended."""
        if caller:
            left = self._arrived.get(caller, 0) - 1
            if left > 0:
                self._arrived[caller] = left
            else:
                self._arrived.pop(caller, None)

    def share_refusal(self, caller: str | None) -> Overloaded | None:
        """The refusal `place` would give this member's call at once because its share of the queue is full, or
        None."""
        lane_key = caller or ANONYMOUS_CALLER
        if lane_key == ANONYMOUS_CALLER or (self._can_start(lane_key, 1) and self._waiting_for_room() is None):
            return None
        waiting = len(self._lanes.get(lane_key, ()))
        if waiting < self.max_queued_per_caller:
            return None
        return Overloaded(f"{waiting} calls of this caller are already waiting on this orchestrator "
                          f"(max_queued_per_caller)", self.retry_after_s)

    def positions(self) -> dict[int, tuple[str, int]]:
        """id(waiter) -> (caller, 1-based place in the order calls will start); for tests and position updates."""
        return {id(w): (w.caller, place) for place, w in enumerate(self._service_order(), start=1)}

    async def close(self) -> None:
        """Cancel position updates still being sent (shutdown)."""
        tasks = list(self._position_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ internals

    def running_share(self, lane_key: str) -> int:
        """How many calls of this caller may run at once."""
        return self.max_per_caller if lane_key == ANONYMOUS_CALLER else self.member_running_share

    def _can_start(self, lane_key: str, places: int) -> bool:
        return self.running + places <= self.max_running and self._within_share(lane_key, places)

    def _within_share(self, lane_key: str, places: int) -> bool:
        return self._running_by_caller.get(lane_key, 0) + places <= self.running_share(lane_key)

    def _waiting_for_room(self) -> str | None:
        """The first lane in turn whose next call its caller's share allows but needs more places than are free:
        they are kept for it (else calls needing one place would take each as it frees, and it would never start)."""
        return next((key for key, lane in self._lanes.items()
                     if self._within_share(key, lane[0].places) and not self._can_start(key, lane[0].places)), None)

    def _start(self, lane_key: str, places: int) -> None:
        self.running += places
        self._running_by_caller[lane_key] = self._running_by_caller.get(lane_key, 0) + places

    def _finish(self, lane_key: str, places: int) -> None:
        self.running -= places
        left = self._running_by_caller[lane_key] - places
        if left:
            self._running_by_caller[lane_key] = left
        else:
            del self._running_by_caller[lane_key]
        self._dispatch()

    async def _unheard_at_turn(self, client: WaitingClient, lane_key: str, places: int) -> bool:
        """A waited call's turn came: whether its client went unheard meanwhile (it may have left seconds ago, and
        "no responders" is a leave only after a grace). Its places then go to the next call at once, not to a run
        that would open its hops' sessions for nobody; LeftQueue once the client is gone, True (wait again, first
        in its lane) once it listens again."""
        try:
            unheard = await client.unheard()
        except BaseException:
            self._finish(lane_key, places)
            raise
        if not unheard:
            return False
        self._finish(lane_key, places)
        if not await client.back_or_gone():
            raise LeftQueue("the client went away while its call waited in the queue")
        return True

    async def _wait(self, lane_key: str, on_position: PositionCallback | None,
                    client_gone: asyncio.Event | None, places: int, *, returning: bool = False) -> None:
        """Wait in the caller's lane until admitted (`returning`: a call whose client came back at its turn waits
        first in its lane, and had its place in the queue already)."""
        if not returning:
            self._make_room_for(lane_key)
        waiter = _Waiter(lane_key, on_position, places)
        lane = self._lanes.setdefault(lane_key, deque())
        if returning:
            lane.appendleft(waiter)
        else:
            lane.append(waiter)
        self._dispatch()
        gone = asyncio.ensure_future(client_gone.wait()) if client_gone is not None else None
        try:
            await asyncio.wait([f for f in (waiter.admitted, gone) if f is not None],
                               return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        finally:
            if gone is not None:
                gone.cancel()
        if not waiter.admitted.done():
            self._abandon(waiter)
            raise LeftQueue("the client went away while its call waited in the queue")
        waiter.admitted.result()  # Overloaded when another caller's call took its place

    def _make_room_for(self, lane_key: str) -> None:
        """Overloaded unless a call of this caller may wait: within its share, and in a free place or one taken
        from the newest call of a caller waiting with at least two more calls (that call is refused instead)."""
        refusal = self.share_refusal(lane_key)
        if refusal is not None:
            raise refusal
        waiting = len(self._lanes.get(lane_key, ()))
        if self.queued < self.max_queued:
            return
        longest = max(self._lanes, key=lambda key: len(self._lanes[key]), default=None)
        if longest is None or len(self._lanes[longest]) < waiting + 2:
            raise Overloaded(f"{self.queued} calls are already waiting on this orchestrator (max_queued_requests)",
                             self.retry_after_s)
        displaced = self._lanes[longest][-1]
        displaced.admitted.set_exception(Overloaded(
            "the queue is full (max_queued_requests) and this caller had the most calls waiting in it: its newest "
            "made room for another caller's", self.retry_after_s))
        self._remove(displaced, dispatch=False)

    def _abandon(self, waiter: _Waiter) -> None:
        admitted = waiter.admitted
        if admitted.done() and not admitted.cancelled() and admitted.exception() is None:
            self._finish(waiter.caller, waiter.places)  # admitted just as it left: give the places back
        else:
            admitted.cancel()
            self._remove(waiter)

    def _remove(self, waiter: _Waiter, *, dispatch: bool = True) -> None:
        lane = self._lanes.get(waiter.caller)
        if lane is not None and waiter in lane:
            lane.remove(waiter)
            if not lane:
                del self._lanes[waiter.caller]
        if dispatch:
            self._dispatch()

    def _dispatch(self) -> None:
        """Start waiting calls while there is room, one lane after the other, then tell the rest their place."""
        progressed = True
        while progressed and self._lanes and self.running < self.max_running:
            progressed = False
            for lane_key in list(self._lanes):
                lane = self._lanes[lane_key]
                if not self._within_share(lane_key, lane[0].places):
                    continue
                if not self._can_start(lane_key, lane[0].places):
                    progressed = False  # the free places are kept for this call, which needs more of them
                    break
                waiter = lane.popleft()
                # This lane was served: it goes to the back of the round.
                del self._lanes[lane_key]
                if lane:
                    self._lanes[lane_key] = lane
                self._start(lane_key, waiter.places)
                waiter.admitted.set_result(None)
                progressed = True
        self._tell_positions()
        queued_requests_gauge.set(self.queued)

    def _service_order(self) -> list[_Waiter]:
        """The waiting calls in the order they would start if places freed one at a time and every caller
        could run: round-robin over the lanes, one call of each per round."""
        lanes = [list(lane) for lane in self._lanes.values()]
        order: list[_Waiter] = []
        for depth in range(max((len(lane) for lane in lanes), default=0)):
            order.extend(lane[depth] for lane in lanes if depth < len(lane))
        return order

    def _tell_positions(self) -> None:
        order = self._service_order()
        for place, waiter in enumerate(order, start=1):
            if waiter.position == place or waiter.on_position is None:
                continue
            waiter.position = place
            task = asyncio.get_running_loop().create_task(waiter.on_position(place, len(order)),
                                                          name="queued-position")
            self._position_tasks.add(task)
            task.add_done_callback(self._position_tasks.discard)
