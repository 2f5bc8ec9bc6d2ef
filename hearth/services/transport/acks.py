"""AckObserver: watches every hop's acks of one pipeline to tell which hop holds a step that has not moved on."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from hearth.protocol.subjects import all_acks_subject
from hearth.services.common.config import TransportSettings
from hearth.services.transport.errors import FrameError, TransportClosed, TransportTimeout
from hearth.services.transport.headers import AckHeader
from hearth.services.transport.mac import ack_witness_is_valid, link_mac_key, mac_is_valid
from hearth.services.transport.subscription import SubscribingEndpoint

log = logging.getLogger(__name__)

_defaults = TransportSettings()


@dataclass
class StepProgress:
    """How far one step got: the highest hop that acked any of its chunks, and how many chunks it acked."""

    session: str
    step: int
    hop: int
    chunk_count: int
    last_ack_monotonic: float
    acked_chunks: set[int] = field(default_factory=set)
    # hop -> when its first ack of this step was seen: how long each hop held the step (the orchestrator's metric).
    first_ack_at: dict[int, float] = field(default_factory=dict)

    @property
    def chunks_acked(self) -> int:
        return len(self.acked_chunks)

    @property
    def fully_acked(self) -> bool:
        """Every chunk of the step reached `hop`."""
        return self.chunks_acked >= self.chunk_count


class AckObserver(SubscribingEndpoint):
    """Listens on ``hearth.ack.*.<pipeline_id>.*`` and keeps, per (session, step), the highest acking hop.

    With `sink_hop` = number of shard hops (the orchestrator's own receiver acks as that hop), a step
    whose highest hop is below the sink and whose last ack is older than `step_timeout_s` is held by
    that hop: ``stalled(step_timeout_s)`` lists them. Memory is bounded per session and in sessions.

    A hop's acks carry its own MAC and witness whatever (session, step, chunk) they name: with `tracked`, only acks of
    the steps it says are awaited are recorded (acks of steps never sent would push the awaited one out of the table,
    and the stall watch, finding no ack of it, would blame hop 0), and with `max_chunks_per_step` only chunks a step
    of the pipeline can have (each other index would take an entry).
    """

    def __init__(
        self,
        nc: NatsClient,
        pipeline_id: str,
        *,
        sink_hop: int | None = None,
        link_keys: dict[int, bytes] | None = None,
        ack_witness_keys: dict[int, bytes] | None = None,
        max_steps_per_session: int = _defaults.ack_observer_max_steps_per_session,
        max_sessions: int = _defaults.ack_observer_max_sessions,
        tracked: Callable[[str, int], bool] | None = None,
        max_chunks_per_step: int | None = None,
    ) -> None:
        self.nc = nc
        self.pipeline_id = pipeline_id
        self.sink_hop = sink_hop
        # hop -> the key of the link into it: an ack without that link's MAC says nothing about the hop.
        self.link_keys = link_keys
        self._mac_keys = {hop: link_mac_key(key) for hop, key in link_keys.items()} if link_keys is not None else None
        # hop -> the key only that hop witnesses its acks with (mac.py): the hop before it, which holds their link's
        # key, cannot ack in its name and so make it look as if it held a step it never got.
        self._witness_keys = ack_witness_keys
        self.max_steps_per_session = max_steps_per_session
        self.max_sessions = max_sessions
        self.tracked = tracked
        self.max_chunks_per_step = max_chunks_per_step
        self.subject = all_acks_subject(pipeline_id)
        self.bad_acks = 0
        self._sessions: OrderedDict[str, OrderedDict[int, StepProgress]] = OrderedDict()
        self._waiters: dict[tuple[str, int], list[tuple[int, asyncio.Future[StepProgress]]]] = {}
        self._sub: Subscription | None = None
        self._closed = False

    def _subscription(self):
        return self.subject, self._on_ack

    def progress(self, session: str, step: int) -> StepProgress | None:
        steps = self._sessions.get(session)
        return steps.get(step) if steps else None

    def holder(self, session: str, step: int) -> int | None:
        """The highest hop that acked the step (None if no hop did yet)."""
        progress = self.progress(session, step)
        return progress.hop if progress else None

    def stalled(self, older_than_s: float, *, now_monotonic: float | None = None) -> list[StepProgress]:
        """Steps not yet acked by the sink (or by any later hop) for longer than `older_than_s`.

        Only the newest acked step of each session is considered: an older step that a newer one
        overtook is not stalled, just finished or abandoned.
        """
        now = time.monotonic() if now_monotonic is None else now_monotonic
        stalled = []
        for steps in self._sessions.values():
            if not steps:
                continue
            newest = steps[max(steps)]
            if self.sink_hop is not None and newest.hop >= self.sink_hop:
                continue
            if now - newest.last_ack_monotonic > older_than_s:
                stalled.append(newest)
        return stalled

    async def wait_for_hop(self, session: str, step: int, hop: int, timeout_s: float) -> StepProgress:
        """Wait until some hop >= `hop` acked the step; TransportTimeout names the hop holding it."""
        progress = self.progress(session, step)
        if progress is not None and progress.hop >= hop:
            return progress
        if self._closed:
            raise TransportClosed(f"ack observer of pipeline {self.pipeline_id} is closed")
        waiter: asyncio.Future[StepProgress] = asyncio.get_running_loop().create_future()
        waiters = self._waiters.setdefault((session, step), [])
        waiters.append((hop, waiter))
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for drops a cancellation that lands as the ack comes.
            async with asyncio.timeout(timeout_s):
                return await waiter
        except TimeoutError:
            held_by = self.holder(session, step)
            raise TransportTimeout(
                f"pipeline {self.pipeline_id}: step {step} of session {session} did not reach hop {hop} within "
                f"{timeout_s} s (held by hop {held_by})",
                pipeline_id=self.pipeline_id,
                hop=-1 if held_by is None else held_by,
                session=session,
                step=step,
                waited_s=timeout_s,
            ) from None
        finally:
            remaining = [entry for entry in self._waiters.get((session, step), []) if entry[1] is not waiter]
            if remaining:
                self._waiters[(session, step)] = remaining
            else:
                self._waiters.pop((session, step), None)

    def forget(self, session: str) -> None:
        self._sessions.pop(session, None)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for waiters in self._waiters.values():
            for _, waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(TransportClosed(f"ack observer of pipeline {self.pipeline_id} closed"))
        self._waiters.clear()
        await self._unsubscribe()

    def record(self, ack: AckHeader, *, now_monotonic: float | None = None) -> StepProgress:
        """Fold one ack into the progress table (the subscription calls this; exposed for reuse)."""
        now = time.monotonic() if now_monotonic is None else now_monotonic
        steps = self._sessions.get(ack.session)
        if steps is None:
            steps = self._sessions[ack.session] = OrderedDict()
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(ack.session)
        progress = steps.get(ack.step)
        if progress is None:
            progress = steps[ack.step] = StepProgress(ack.session, ack.step, ack.hop, ack.chunk_count, now)
            while len(steps) > self.max_steps_per_session:
                steps.popitem(last=False)
        if ack.hop not in progress.first_ack_at:
            progress.first_ack_at[ack.hop] = now
        if ack.hop > progress.hop:
            progress.hop, progress.chunk_count = ack.hop, ack.chunk_count
            progress.acked_chunks.clear()
        if ack.hop == progress.hop:
            progress.acked_chunks.add(ack.chunk_index)
            progress.last_ack_monotonic = now
        waiters = self._waiters.get((ack.session, ack.step))
        if waiters:
            for hop, waiter in waiters:
                if progress.hop >= hop and not waiter.done():
                    waiter.set_result(progress)
        return progress

    async def _on_ack(self, msg: Msg) -> None:
        try:
            ack = AckHeader.from_nats_headers(msg.headers)
            if ack.pipeline_id != self.pipeline_id:
                raise FrameError(f"ack for pipeline {ack.pipeline_id} on {msg.subject}")
            key = self._mac_keys.get(ack.hop) if self._mac_keys is not None else None
            if self._mac_keys is not None and (key is None or not mac_is_valid(key, msg.headers, msg.data)):
                raise FrameError(f"ack for hop {ack.hop} without its link's MAC on {msg.subject}")
            witness_key = self._witness_keys.get(ack.hop) if self._witness_keys is not None else None
            if self._witness_keys is not None and (witness_key is None
                                                   or not ack_witness_is_valid(witness_key, msg.headers)):
                raise FrameError(f"ack for hop {ack.hop} without its own witness on {msg.subject}")
        except FrameError as error:
            self.bad_acks += 1
            log.warning("ignoring bad ack on %s: %s", msg.subject, error)
            return
        if self.tracked is not None and not self.tracked(ack.session, ack.step):
            return  # a step not awaited (done, never sent, another session's): nothing to tell
        if self.max_chunks_per_step is not None and ack.chunk_count > self.max_chunks_per_step:
            self.bad_acks += 1
            return
        self.record(ack)
