"""StallWatch: decides, while a step is held somewhere in a chain, which hop is to blame and when.

Who is to blame for a stalled step: the acks say which hop last took the step in (hop h), but not whether
h is slow or the hop after it never received h's output (it died, or is frozen with its connection still
open). So the watch probes hops h and h+1 with a `stat` control request: a hop that does not answer within
the probe's time (or has no responder at all) is the culprit; when both answer, h holds the step and is the
one to route around. The probe starts `probe_timeout_s` (at most half the step timeout) before the step
times out, so the verdict is there when it does: a stall is declared within the step timeout.

A host that died (killed, crashed, unplugged) need not wait that long: its NATS connection is gone, and
with it the subscription on its control subject, so a request there fails at once with "no responders".
Once a step has been held `gone_check_after_s` (far longer than a step normally takes, far shorter than
the step timeout), the watch asks the suspects, and asks again every `gone_check_after_s` while the step stays
held (a host may die while the hop before it still computes a long prefill); one without a responder is failed
over right away. One that answers but no longer lists the pipeline among its open ones closed its hop (its watchdog
did, or it dropped the hops of an orchestrator whose key the event log retired, docs/trust.md "Work in flight"): the
step will never be taken in there, so it fails at once as `evicted` (the call re-opens the hop, as after a
`session_evicted` notice) rather than at the step timeout.
A host whose link is cut (its process running on) still has its subscriptions at the broker until the broker
gives up on its connection, so a request there is silent instead: a suspect that stays silent through the gone
check and a second probe of `probe_timeout_s` is failed over too, unless the step moved on meanwhile, or our own
connection did not answer a ping meanwhile either: then our link is the one cut, a `broker` failure blaming nobody.
A busy host is not taken for one: its control loop answers `stat` while its compute thread runs a step (even a long
prefill). A merely slow host answers, and is left to the step timeout.

The watch looks on every `poll_s` while a step's output is awaited, and also while the step is still being sent and
waits for window space (hop 0 stopped acking: a step of more chunks than the window, or the first chunks of a
pipelined prefill): a hop 0 that died then is failed over as soon as it would be once the step was out.
"""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client as NatsClient

from hearth.services.broker.connection import answers_ping
from hearth.services.common.config import TransportSettings
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.orchestrator.router import Hop
from hearth.services.transport import AckObserver, StepInfo, TransportError, WindowCheck
from hearth.services.transport.probe import ProbeOutcome, holds_no_hop_of, probe_outcome, probe_stat

# How often (a fraction of the step timeout, and at least twice per gone check) a waiting step is looked at.
stall_poll_fraction = 0.1
shortest_poll_s = 0.01


class HopHeld(TransportError):
    """The watch's verdict on a step still being sent, raised out of its wait for window space."""

    def __init__(self, failure: StepFailure) -> None:
        super().__init__(f"{failure.kind}: {failure.reason}")
        self.failure = failure


class StallWatch:
    """Looked at by HopChain every poll while a step is outstanding; gives a StepFailure once one is due."""

    def __init__(self, nc: NatsClient, hops: list[Hop], observer: AckObserver, transport: TransportSettings, *,
                 first_hop: int = 0, pipeline_id: str | None = None) -> None:
        self.nc = nc
        # The pipeline whose steps are watched: a suspect whose `stat` no longer lists it closed its hop.
        self.pipeline_id = pipeline_id
        # The pipeline's index of hops[0]: acks name hops by the pipeline's index.
        self.first_hop = first_hop
        self.hops = hops
        self.observer = observer
        self.transport = transport
        # The liveness probe of the step currently held too long: (step, holder hop) and its task.
        self._probe_key: tuple[int, int] | None = None
        self._probe: asyncio.Task | None = None
        # The (step, holder hop) whose suspects were last checked for a lost connection, and when to check again.
        self._gone_checked: tuple[int, int] | None = None
        self._next_gone_check = 0.0

    @property
    def poll_s(self) -> float:
        """How often a step held somewhere is looked at."""
        return max(shortest_poll_s, min(self.transport.step_timeout_s * stall_poll_fraction,
                                        self.transport.gone_check_after_s / 2))

    def window_check(self, info: StepInfo, sent_at: float, timeout_s: float) -> WindowCheck:
        """The check of a step whose send waits for window space: raises HopHeld once the watch fails it."""
        async def check() -> None:
            failure = await self.check(info, sent_at, timeout_s)
            if failure is not None:
                raise HopHeld(failure)

        return WindowCheck(self.poll_s, check)

    def cancel(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        self._probe, self._probe_key = None, None

    async def check(self, info: StepInfo, sent_at: float, timeout_s: float) -> StepFailure | None:
        progress = self.observer.progress(info.session, info.step)
        now = time.monotonic()
        if progress is None:
            holder, since = 0, sent_at
        else:
            # Every chunk acked by hop h: hop h holds it until hop h+1 acks. Some of them: the hop before still owes
            # the rest (it could send a chunk, then a later step whole, and have h drop the rest and be blamed). Acked
            # by our own receiver (the sink) while the output is still awaited: the last hop owes the rest of its
            # chunks, and is blamed as any holder is (a sink's ack, which the last hop can forge with their shared
            # link key, never waits out the call).
            holder = progress.hop - self.first_hop - (not progress.fully_acked)
            holder, since = min(max(holder, 0), len(self.hops) - 1), progress.last_ack_monotonic
        # Hop 0 never acked: nobody after it is involved. Otherwise the next hop may be the one gone.
        suspects = [i for i in ([holder] if progress is None else [holder, holder + 1]) if i < len(self.hops)]
        held_s = now - since
        probe_s = min(self.transport.probe_timeout_s, self.transport.step_timeout_s / 2)
        if held_s > self.transport.gone_check_after_s and (self._gone_checked != (info.step, holder)
                                                            or now >= self._next_gone_check):
            self._gone_checked = (info.step, holder)
            failure = await self._check_reachable(info, suspects, held_s, probe_s)
            if failure is not None:
                return failure
            self._next_gone_check = time.monotonic() + self.transport.gone_check_after_s
        if len(suspects) > 1 and held_s > timeout_s - probe_s and self._probe_key != (info.step, holder):
            self.cancel()
            self._probe_key = (info.step, holder)
            self._probe = asyncio.create_task(self._answered(suspects, probe_s), name="hop-probe")
        if held_s <= timeout_s:
            return None
        culprit = await self._blame(suspects)
        if culprit == holder:
            reason = f"step {info.step} not passed on within {timeout_s:.1f} s"
        else:
            reason = f"does not answer; step {info.step} not taken in within {timeout_s:.1f} s"
        return StepFailure("stalled", self.hops[culprit].shard_id, reason)

    def _position(self, info: StepInfo) -> tuple[int, float] | None:
        """The highest hop that acked the step and when its last ack came (None before any)."""
        progress = self.observer.progress(info.session, info.step)
        return None if progress is None else (progress.hop, progress.last_ack_monotonic)

    async def _check_reachable(self, info: StepInfo, suspects: list[int], held_s: float,
                               probe_s: float) -> StepFailure | None:
        """The gone check: a suspect without a responder is gone; one silent to it and to a second probe of
        `probe_s` is unreachable (a cut link, or a frozen host), unless the step was passed on meanwhile."""
        position = self._position(info)
        probed = await asyncio.gather(*(probe_stat(self.nc, self.hops[i], self.transport.gone_check_timeout_s)
                                        for i in suspects))
        outcomes = [outcome for outcome, _ in probed]
        for index, (outcome, stat) in zip(suspects, probed):
            if outcome is ProbeOutcome.no_responder:
                return StepFailure("gone", self.hops[index].shard_id,
                                   f"no longer connected (no responder on its control subject); step "
                                   f"{info.step} held {held_s:.2f} s")
            if stat is not None and self.pipeline_id is not None and holds_no_hop_of(stat, self.pipeline_id):
                return StepFailure("evicted", self.hops[index].shard_id,
                                   f"step {info.step}: its hop is no longer open there (the shard closed it); held "
                                   f"{held_s:.2f} s")
        silent = [index for index, outcome in zip(suspects, outcomes) if outcome is ProbeOutcome.silent]
        if not silent:
            return None
        # Every hop is silent to us when our own link is cut, and nats-py notices only once its pings go unanswered.
        confirmed, linked = await asyncio.gather(self._outcomes(silent, probe_s), answers_ping(self.nc, probe_s))
        if not linked:
            return StepFailure("broker", None, f"the connection to the NATS broker does not answer a ping (our link is "
                                               f"cut); step {info.step} held {held_s:.2f} s")
        if self._position(info) != position:
            return None  # acked by another hop meanwhile: whoever was silent is not what holds it up
        waited_s = self.transport.gone_check_timeout_s + probe_s
        for index, outcome in zip(silent, confirmed):
            if outcome is not ProbeOutcome.answered:
                return StepFailure("stalled", self.hops[index].shard_id,
                                   f"does not answer probes for {waited_s:.2f} s (link cut, or host frozen); "
                                   f"step {info.step} held {held_s:.2f} s")
        return None

    async def _blame(self, suspects: list[int]) -> int:
        """The first suspect hop that does not answer a probe; the first suspect when every one answers."""
        if len(suspects) == 1:
            return suspects[0]
        probe, self._probe, self._probe_key = self._probe, None, None
        answers = await (probe if probe is not None else self._answered(suspects, self.transport.probe_timeout_s))
        for index, answered in zip(suspects, answers):
            if not answered:
                return index
        return suspects[0]

    async def _answered(self, suspects: list[int], timeout_s: float) -> list[bool]:
        return [outcome is ProbeOutcome.answered for outcome in await self._outcomes(suspects, timeout_s)]

    async def _outcomes(self, suspects: list[int], timeout_s: float) -> list[ProbeOutcome]:
        return list(await asyncio.gather(*(probe_outcome(self.nc, self.hops[i], timeout_s) for i in suspects)))
