"""ClientStream: a call's outbox, which numbers its frames, publishes them to the client's inbox, notices the client
leaving, and sends again what a client missed while the broker reorganized.

A client that goes away (its connection closed, or it stopped reading and unsubscribed its inbox) is noticed
through NATS "no responders": every frame is published with a reply subject of ours naming it, and when nobody
listens on the client's inbox any more the server answers that publish with a 503 status. A client whose broker
node went away is not listened for either until it subscribed again on another node, so 503s are a leave only
once they lasted `client_missing_grace_s`, or `client_resubscribe_grace_s` after our own connection reconnected
(the whole broker may have restarted). Frames can also vanish without any answer: those the broker had already
handed to a client connection that then dropped, and those we wrote just before our own connection dropped. So
after either sign (a 503, or a reconnect of ours) the kept frames are sent again, in order, once a probe finds the
client's inbox listened to again; a client skips a `seq` it has already seen and holds frames that come after a
gap until the gap is filled (docs/protocol.md, "Frames").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from hearth.protocol.chat_frames import KeepaliveFrame, QueuedFrame, TokenDeltaFrame
from hearth.services.broker.connection import NO_RESPONDERS_STATUS, answers_ping
from hearth.services.common.lifecycle import event_within
from hearth.services.orchestrator.metrics import final_frame_code

log = logging.getLogger(__name__)

# Event-loop turns after a flush for a subscription callback to run (its message is already read).
status_dispatch_yields = 3
# The newest frames a call keeps to send again (a call's frames are small, but how many is the client's choice).
replayable_frames = 1024
# How often one call sends its kept frames again: a client that keeps leaving and coming back gets no more.
replays_per_call = 8
# The last token of a keepalive's status subject (a numbered frame's is its seq).
_KEEPALIVE_STATUS_TOKEN = "k"


class ClientStream:
    """Numbers frames (monotonic `seq`), publishes them to one reply subject, notices the client leaving, and sends
    again what the client missed while the broker reorganized."""

    def __init__(self, nc: NatsClient, reply_subject: str, *, resubscribe_grace_s: float, missing_grace_s: float,
                 probe_timeout_s: float) -> None:
        self.nc = nc
        self.reply_subject = reply_subject
        self.resubscribe_grace_s = resubscribe_grace_s
        self.missing_grace_s = missing_grace_s
        self.probe_timeout_s = probe_timeout_s
        self.seq = 0
        self.tokens_sent = 0
        # "ok" or the error code of the final frame sent (None: none yet), for hearth_requests_total.
        self.final_code: str | None = None
        self.last_sent_at = time.monotonic()
        self.client_gone = asyncio.Event()
        self.frames_sent_again = 0
        self.replays = 0
        self._missed_frames = 0
        # When "no responders" began (None: the client was listening when last heard of).
        self._missing_since: float | None = None
        self._status_inbox: str | None = None
        self._status_sub = None
        self._reconnects = nc.stats["reconnects"]
        self._reconnect_noticed_at = float("-inf")
        # The call's final frame, held back while `final_frame_last` holds it (None: none held).
        self._holding_final = False
        self._held_final = None
        self._kept: deque[bytes] = deque(maxlen=replayable_frames)
        # Whether the kept frames are to be sent again once the client listens again.
        self._replay_due = False
        # Called once, just before the final frame goes out (or by `final_going` if none does): see `on_final`.
        self._on_final: Callable[[], None] | None = None

    async def start(self) -> "ClientStream":
        self._status_inbox = self.nc.new_inbox()
        self._status_sub = await self.nc.subscribe(f"{self._status_inbox}.*", cb=self._on_status)
        return self

    @contextlib.asynccontextmanager
    async def final_frame_last(self):
        """Holds the call's final frame back until the body ended: a client that saw it may call again at once,
        because the call has let go of its running place and told its hops to close by then."""
        self._holding_final = True
        try:
            yield
        finally:
            self._holding_final = False
            held, self._held_final = self._held_final, None
            if held is not None:
                await self.send(held)

    def on_final(self, callback: Callable[[], None]) -> None:
        """Have `callback` run once, just before the call's final frame goes out (or at `final_going`): what the call
        gives back then (its caller's share) is back before a client that saw the frame can call again."""
        self._on_final = callback

    def final_going(self) -> None:
        """Run the `on_final` callback unless it ran already (the call ends without a final frame, or with one)."""
        callback, self._on_final = self._on_final, None
        if callback is not None:
            callback()

    async def send(self, frame) -> None:
        if final_frame_code(frame) is not None:
            if self._holding_final:
                self._held_final = frame
                return
            self.final_going()
        self._reconnected_recently()
        await self._replay_missed()
        if isinstance(frame, KeepaliveFrame):
            # Not numbered (it repeats the last seq): a lost keepalive is no gap in what the client must see.
            await self._publish_keepalive()
            return
        numbered = frame.model_copy(update={"seq": self.seq})
        self.seq += 1
        if isinstance(frame, TokenDeltaFrame):
            self.tokens_sent += 1
        else:
            self.final_code = final_frame_code(frame) or self.final_code
        data = numbered.model_dump_json().encode()
        self._kept.append(data)
        self.last_sent_at = time.monotonic()
        await self.nc.publish(self.reply_subject, data, reply=self._status_subject(str(numbered.seq)))

    async def tell_position(self, position: int, queued: int) -> None:
        """Tell the client its place in the queue (a `queued` frame; the queue's position callback)."""
        with contextlib.suppress(Exception):  # the client or the broker is gone: its call leaves the queue anyway
            await self.send(QueuedFrame(seq=0, position=position, queued_requests=queued))

    async def keep_alive(self, interval_s: float) -> None:
        """A keepalive frame when nothing else went out for `interval_s` (and what the client missed, once it
        listens again)."""
        if time.monotonic() - self.last_sent_at >= interval_s or self._replay_due:
            await self.send(KeepaliveFrame(seq=0))

    async def reachable(self, timeout_s: float) -> bool:
        """Whether the client's inbox has a subscriber again (after a broker restart the client resubscribes
        when its own connection is back): a keepalive that nobody received comes back as "no responders",
        which the server sends before it answers the flush's ping."""
        missed = self._missed_frames
        await self._publish_keepalive()
        if not await self._flushed(timeout_s) or self._missed_frames != missed:
            return False
        self._missing_since = None
        return True

    async def unheard(self) -> bool:
        """Whether nobody listens on the client's inbox now: a keepalive to it came back "no responders" (a probe
        that got no answer in time proves nothing). Asked when a queued call's turn comes (FairQueue.place)."""
        missed = self._missed_frames
        try:
            await self._publish_keepalive()
            flushed = await self._flushed(self.probe_timeout_s)
        except Exception:  # the broker is away: that says nothing of the client
            return False
        return flushed and self._missed_frames != missed

    async def back_or_gone(self) -> bool:
        """After `unheard`: probe the client's inbox until it is listened to again (True), or until the client is
        gone (False: its "no responders" outlasted the grace). Bounded by the longer grace: past it, True (our own
        link may be what failed; the call's turn comes again and asks `unheard` again)."""
        deadline = time.monotonic() + max(self.resubscribe_grace_s, self.missing_grace_s) + self.probe_timeout_s
        while not self.client_gone.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(Exception):  # the broker is away: probe again
                if await self.reachable(self.probe_timeout_s):
                    return True
            await event_within(self.client_gone, self.probe_timeout_s)
        return not self.client_gone.is_set()

    async def settle(self) -> None:
        """At the call's end: wait for the answers to what was sent, and send again what the client missed, for at
        most the longer grace (the final frame too may have gone while the broker reorganized)."""
        deadline = time.monotonic() + max(self.resubscribe_grace_s, self.missing_grace_s)
        self._reconnected_recently()
        if not await self._flushed(self.probe_timeout_s):
            return
        while self._replay_due and not self.client_gone.is_set() and time.monotonic() < deadline:
            await self._replay_missed()
            if self._replay_due or not await self._flushed(self.probe_timeout_s):
                await asyncio.sleep(self.probe_timeout_s)

    async def close(self) -> None:
        sub, self._status_sub = self._status_sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _replay_missed(self) -> None:
        """Send the kept frames again, in order, once the client listens again."""
        if not self._replay_due or not self.nc.is_connected:
            return
        if not await self.reachable(self.probe_timeout_s):
            return
        self._replay_due = False
        self.replays += 1
        if self.replays == replays_per_call:
            log.warning("%s: the kept frames go again for the last time (%d a call): what the client misses from now "
                        "on is not sent again", self.reply_subject, replays_per_call)
        frames = list(self._kept)
        first = self.seq - len(frames)
        for seq, data in enumerate(frames, start=first):
            await self.nc.publish(self.reply_subject, data, reply=self._status_subject(str(seq)))
        self.frames_sent_again += len(frames)
        self.last_sent_at = time.monotonic()
        log.info("%s: sent the last %d frames again (the client may have missed some while the broker reorganized)",
                 self.reply_subject, len(frames))

    async def _publish_keepalive(self) -> None:
        frame = KeepaliveFrame(seq=max(self.seq - 1, 0))
        self.last_sent_at = time.monotonic()
        await self.nc.publish(self.reply_subject, frame.model_dump_json().encode(),
                              reply=self._status_subject(_KEEPALIVE_STATUS_TOKEN))

    def _status_subject(self, token: str) -> str:
        return f"{self._status_inbox}.{token}" if self._status_inbox else ""

    async def _flushed(self, timeout_s: float) -> bool:
        """Whether every publish so far reached the broker within `timeout_s`, its "no responders" answers read."""
        if not await answers_ping(self.nc, timeout_s):
            return False
        # The status messages have been read off the socket; let their subscription's callback run.
        for _ in range(status_dispatch_yields):
            await asyncio.sleep(0)
        return True

    async def _on_status(self, msg: Msg) -> None:
        no_responders = msg.headers is not None and msg.headers.get("Status") == NO_RESPONDERS_STATUS
        if not no_responders:
            return
        self._missed_frames += 1
        now = time.monotonic()
        if self._missing_since is None:
            self._missing_since = now
        if not self._reconnected_recently() and now - self._missing_since >= self.missing_grace_s:
            self.client_gone.set()
            return
        # A keepalive unheard after the final frame went out: the client most likely left having read it.
        if msg.subject.rpartition(".")[2] != _KEEPALIVE_STATUS_TOKEN or self.final_code is None:
            self._mark_replay_due()

    def _reconnected_recently(self) -> bool:
        count = self.nc.stats["reconnects"]
        now = time.monotonic()
        if count != self._reconnects:
            self._reconnects, self._reconnect_noticed_at = count, now
            self._mark_replay_due()
        return now - self._reconnect_noticed_at < self.resubscribe_grace_s

    def _mark_replay_due(self) -> None:
        self._replay_due = bool(self._kept) and self.replays < replays_per_call
