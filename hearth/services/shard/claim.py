"""A shard process's claim on its id: of the processes that start under one shard id, exactly one keeps it.

Two processes under one id would share its subjects and read-model row, each answering the other's hops' opens and
steps. A starting shard listens on its control subject first, then asks there (`stat` with its `claim`: 128 random
bits, and when it made it). Claims are ranked, the earliest first and then the lowest nonce (ClaimRank), and a
process gives way, for good, to every claim it hears that outranks its own, however late and in whatever order:

- a claim heard on its control subject that outranks its own is never answered; one it outranks is answered at once
  with its own claim (while it decides and while it serves), which makes the asker give way;
- it hears answers to its own claim for as long as it runs, not only while it decides: an answer slower than
  `[transport] probe_timeout_s` (a busy event loop, a loaded broker) still makes it give way, even once it serves.
  An answer without a rank comes from a shard from before ranks that serves the id, which keeps it;
- it keeps its id when nothing that outranks it was heard within `probe_timeout_s` of asking, and asks again after
  a reconnect (the broker drops what comes while a process is cut off).

So the process whose claim ranks first never gives way, and every other one hears of it: it asked after that one
subscribed (and is answered) or before (and hears its claim). Listening before asking is what makes that so. A process
serving an id ranks before any that starts later, so a newcomer never displaces it; a crashed or frozen run does not
answer, and one starting then keeps the id, but a frozen run that thaws and answers its claim keeps it again (the
newcomer gives way). Ranks read the clocks of the processes' machines: a clock set back by more than a rival's head
start only changes which one keeps the id, never that exactly one does. A process that gives way answers nothing,
withdraws nothing, and stops with `taken`. Should the first claim's process die while the others give way to it,
none serves until one starts again. (A compare-and-set on the broker, a JetStream KV `create`, would need new
permissions for every role and a lease that lets a crashed run's id go; ranked claims need neither.)

On a community mesh a claim is signed with the node's own member key and heard as a rival's only when that key
signed it: orchestrators may publish on every shard's control subject, and an unsigned early claim would otherwise make
a starting shard refuse its own id. Only the node's processes (and the steward) hear a claim, so none is replayed. On
an open mesh claims go unsigned, as everything does there.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from hearth.protocol.control import ClaimRank, ShardStat, StatShard
from hearth.services.common.call_signing import signed_by, signed_call_headers
from hearth.services.common.lifecycle import CommandRefused, event_within
from hearth.trust.keys import MemberKey


class ShardIdTaken(CommandRefused):
    """Another process of this node keeps the shard id (a `hearth host` then chooses another range)."""


def taken(shard_id: str) -> ShardIdTaken:
    """The one-line refusal of a process that may not serve `shard_id`: another process keeps it."""
    return ShardIdTaken(f"shard {shard_id} is already served by another process on this node: stop it, or serve "
                          "another range or scheme, or give another --node-id")


class ShardClaim:
    """One process's claim on its shard id: its rank, what it heard from other processes under that id, its verdict."""

    def __init__(self, key: MemberKey | None = None, clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.nonce = secrets.token_hex(16)
        self.key = key  # the node's member key, which signs its claims (None: an open mesh)
        self.kept: bool | None = None  # None while deciding; False once it gave way, for good
        self.settled = asyncio.Event()
        self.lost = asyncio.Event()
        self._clock_ns = clock_ns
        self._rank: ClaimRank | None = None
        self._outranked = False  # heard, while deciding, of a claim that outranks this one

    @property
    def deciding(self) -> bool:
        return self.kept is None

    @property
    def rank(self) -> ClaimRank:
        """This process's claim and when it made it: when it first asked or heard a claim, after it subscribed."""
        if self._rank is None:
            self._rank = ClaimRank(at_ns=self._clock_ns(), nonce=self.nonce)
        return self._rank

    def question(self) -> StatShard:
        return StatShard(claim=self.nonce, claimed_at_ns=self.rank.at_ns)

    def answer_fields(self) -> dict[str, object]:
        """The claim fields of an answer to another's claim: its rank. No `claim`: a shard from before ranks then
        takes this one for serving the id and refuses, as it should (its own untimed claim ranks last)."""
        return {"claimed": self.rank}

    def headers(self, control_subject: str, reply: str, body: bytes) -> dict[str, str] | None:
        """What signs this process's claim (None on an open mesh)."""
        return signed_call_headers(self.key, control_subject, reply, body) if self.key is not None else None

    def from_this_node(self, msg: Msg) -> bool:
        """Whether a claim heard on the control subject comes from a process of this node: signed with its key (on an
        open mesh, any claim). Another one is a plain `stat`, answered once this process has decided."""
        if self.key is None:
            return True
        return signed_by(self.key.public_key, msg.subject, msg.reply, msg.data, msg.headers)

    def hear_claim(self, request: StatShard) -> bool:
        """Another process under this id asked: whether to answer it, which it gives way to. Not when this process
        gave way, nor to its own claim; a claim that outranks this one makes this process give way instead. A claim
        with no time (a shard from before ranks) ranks after every timed one."""
        if self.kept is False or request.claim is None or request.claim == self.nonce:
            return False
        heard = ClaimRank(at_ns=request.claimed_at_ns if request.claimed_at_ns is not None else 2**63 - 1,
                          nonce=request.claim)
        if heard.before(self.rank):
            self._give_way()
            return False
        return True

    def hear_answer(self, data: bytes) -> None:
        """An answer to this process's claim, however late: from a process whose claim outranks it (it answers no
        other), or from a shard from before ranks that serves the id."""
        try:
            answered = ShardStat.model_validate_json(data).claimed
        except ValidationError:  # a shard that does not know claims refuses the field, and so proves it serves
            answered = None
        if self.kept is False or (answered is not None and answered.nonce == self.nonce):
            return
        if answered is None or answered.before(self.rank):
            self._give_way()

    def decide(self) -> bool:
        """Whether this process keeps its id: nothing that outranks its claim was heard while it decided."""
        if self.deciding:
            self.kept = not self._outranked
        if not self.kept:
            self.lost.set()
        self.settled.set()
        return self.kept

    async def settle(self, timeout_s: float) -> bool:
        """Whether this process keeps its id, once it has decided (False when not decided within `timeout_s`)."""
        # event_within, not wait_for: a control request cancelled here (the shard stopping) must not go on.
        await event_within(self.settled, timeout_s)
        return self.kept is True

    def _give_way(self) -> None:
        if self.deciding:  # decided at its deadline, as the process's start expects
            self._outranked = True
            return
        self.kept = False
        self.lost.set()


class ClaimQuestion:
    """This process's claim asked on its control subject, and every answer to it heard for as long as it runs."""

    def __init__(self, nc: NatsClient, control_subject: str, claim: ShardClaim) -> None:
        self.nc = nc
        self.control_subject = control_subject
        self.claim = claim
        self._answers: Subscription | None = None
        self._inbox = ""

    async def ask(self) -> None:
        """Ask (again: after a reconnect) who else answers under this id; answers go on to `claim` as they come."""
        if self._answers is None:
            self._inbox = self.nc.new_inbox()
            self._answers = await self.nc.subscribe(self._inbox, cb=self._hear)
        body = self.claim.question().model_dump_json().encode()
        await self.nc.publish(self.control_subject, body, reply=self._inbox,
                              headers=self.claim.headers(self.control_subject, self._inbox, body))

    async def close(self) -> None:
        if self._answers is not None:
            with contextlib.suppress(Exception):
                await self._answers.unsubscribe()
            self._answers = None

    async def _hear(self, msg: Msg) -> None:
        self.claim.hear_answer(msg.data)


async def unless_taken(ended: Awaitable[None], claim: ShardClaim, shard_id: str) -> None:
    """Await `ended` (a serving process's stop); raise `taken` first if `claim` gives way meanwhile (an answer to it
    that came late, or a claim that outranks it)."""
    ending = asyncio.ensure_future(ended)
    lost = asyncio.ensure_future(claim.lost.wait())
    try:
        await asyncio.wait((ending, lost), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (ending, lost):
            task.cancel()
        await asyncio.gather(ending, lost, return_exceptions=True)
    if not ending.cancelled():
        ending.result()  # its own end, or what it raised
    else:
        raise taken(shard_id)
