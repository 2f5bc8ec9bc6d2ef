"""A starting shard's claim on its id: of the processes that start under one shard id, exactly one keeps it.

Two processes under one id would share its subjects and read-model row, each answering the other's hops' opens and
steps. A starting shard listens on its control subject first, then asks there (`stat` with its `claim`, 128 random
bits) and hears every answer for `[transport] probe_timeout_s`: a process that answers without a claim serves the id
and the newcomer refuses; one that answers with its own claim is starting too, and the lowest claim keeps the id.
Listening before asking closes the window a plain probe leaves open: of two processes starting at once, the later one
to ask is heard by the other, which answers it, so both know of both, whichever machine each runs on. A crashed or
frozen earlier run does not answer, and is replaced; a process that lost falls silent at once.

On a community mesh a claim is signed with the node's own member key and heard as a rival's only when that key
signed it: orchestrators may publish on every shard's control subject, and an unsigned low claim would otherwise make
a starting shard refuse its own id. Only the node's processes (and the steward) hear a claim, so none is replayed. On
an open mesh claims go unsigned, as everything does there.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from pydantic import ValidationError

from hearth.protocol.control import ShardStat, StatShard
from hearth.services.common.call_signing import signed_by, signed_call_headers
from hearth.services.common.lifecycle import CommandRefused
from hearth.trust.keys import MemberKey


def taken(shard_id: str) -> CommandRefused:
    """The one-line refusal of a process that may not serve `shard_id`: another process keeps it."""
    return CommandRefused(f"shard {shard_id} is already served by another process on this node: stop it, or serve "
                          "another range or scheme, or give another --node-id")


class ShardClaim:
    """One start's claim on its shard id: what it heard from other processes under that id, and its verdict."""

    def __init__(self, key: MemberKey | None = None) -> None:
        self.nonce = secrets.token_hex(16)
        self.key = key  # the node's member key, which signs its claims (None: an open mesh)
        self.kept: bool | None = None  # None while deciding
        self.settled = asyncio.Event()
        self._rivals: set[str] = set()
        self._served_elsewhere = False

    @property
    def deciding(self) -> bool:
        return self.kept is None

    def answer_claim(self) -> str | None:
        """The claim a `stat` answer carries: this process's own while it decides, None once it serves."""
        return self.nonce if self.deciding else None

    def headers(self, control_subject: str, reply: str, body: bytes) -> dict[str, str] | None:
        """What signs this process's claim (None on an open mesh)."""
        return signed_call_headers(self.key, control_subject, reply, body) if self.key is not None else None

    def from_this_node(self, msg: Msg) -> bool:
        """Whether a claim heard on the control subject comes from a process of this node: signed with its key (on an
        open mesh, any claim). Another one is a plain `stat`, answered once this process has decided."""
        if self.key is None:
            return True
        return signed_by(self.key.public_key, msg.subject, msg.reply, msg.data, msg.headers)

    def hear_claim(self, claim: str) -> None:
        """Another process starting under this id asked: a rival while this one still decides (once decided, the
        answer says so and the asker refuses)."""
        if self.deciding and claim != self.nonce:
            self._rivals.add(claim)

    def hear_answer(self, data: bytes) -> None:
        """An answer to this process's claim: from one serving the id, or one starting under it too."""
        try:
            claim = ShardStat.model_validate_json(data).claim
        except ValidationError:  # a shard that does not know claims refuses the field, and so proves it serves
            claim = None
        if claim is None:
            self._served_elsewhere = True
        elif claim != self.nonce:
            self._rivals.add(claim)

    def decide(self) -> bool:
        """Whether this process keeps its id: nobody serves it and no rival's claim is lower."""
        self.kept = not self._served_elsewhere and all(self.nonce < rival for rival in self._rivals)
        self.settled.set()
        return self.kept

    async def settle(self, timeout_s: float) -> bool:
        """Whether this process keeps its id, once it has decided (False when not decided within `timeout_s`)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.settled.wait(), timeout=timeout_s)
        return self.kept is True


async def claim_answers(nc: NatsClient, control_subject: str, claim: ShardClaim, timeout_s: float) -> None:
    """Ask on `control_subject` who else answers under this id, and tell `claim` every answer heard within
    `timeout_s` (not only the first: a rival and a serving process may both answer)."""
    inbox = nc.new_inbox()
    answers = await nc.subscribe(inbox)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        body = StatShard(claim=claim.nonce).model_dump_json().encode()
        await nc.publish(control_subject, body, reply=inbox, headers=claim.headers(control_subject, inbox, body))
        while (left_s := deadline - loop.time()) > 0:
            try:
                message = await answers.next_msg(timeout=left_s)
            except NatsTimeoutError:
                break
            claim.hear_answer(message.data)
    finally:
        with contextlib.suppress(Exception):
            await answers.unsubscribe()
