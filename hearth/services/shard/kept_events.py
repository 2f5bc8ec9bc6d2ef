"""A shard host's event outbox: what it says once and never again (a withdrawal) is kept in a file until JetStream
stored it, written as soon as the broker takes it and, if the process ends first, by the node's next shard host
(hearth/events/outbox.py). Its advertisements and heartbeats go out directly: they are sent again anyway."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from nats.aio.client import Client as NatsClient

from hearth.events.models import EventEnvelope
from hearth.events.outbox import EventOutbox
from hearth.events.outbox_file import OutboxFileUnavailable
from hearth.services.broker.connection import key_refused_event
from hearth.services.common.config import HearthSettings
from hearth.services.common.hearth_files import state_dir
from hearth.services.common.lifecycle import CommandRefused
from hearth.trust.keys import MemberKey

log = logging.getLogger(__name__)

# A host says a few things once per run; what earlier runs left (each killed with the broker down) takes room too.
outbox_max_events = 64
outbox_retry_wait_s = 1.0


def shard_outbox_dir(settings: HearthSettings) -> Path:
    """`[shard] event_outbox_dir`, else the state folder's shard-event-outbox (not an orchestrator's: one node may run
    both, and each process writes what its own kind left)."""
    return settings.shard.event_outbox_dir or state_dir("shard-event-outbox")


def shard_outbox(nc: NatsClient, signing_key: MemberKey | None) -> EventOutbox:
    """An outbox writing on `nc`, which waits for nothing while the broker refuses its key (the host's member removed,
    or its key rotated): a host stopping then keeps its withdrawal for the node's next host at once."""
    return EventOutbox(nc.jetstream(), max_queued=outbox_max_events, retry_wait_s=outbox_retry_wait_s,
                       signing_key=signing_key, unsendable=key_refused_event(nc))


async def start_outbox(outbox: EventOutbox, folder: Path | None, node_id: str, timeout_s: float) -> None:
    """Start `outbox` with the file of `node_id`'s it claims in `folder` (in memory only when None), and give what the
    node's previous shard host left up to `timeout_s` to be stored, so that it goes before this host's advertisement
    (else it is written as soon as it can be). A folder where none may be claimed refuses the command, in one line."""
    try:
        await outbox.start_in(folder, owner=node_id)
    except OutboxFileUnavailable as error:
        raise CommandRefused(f"{error} (give [shard] event_outbox_dir, HEARTH_SHARD__EVENT_OUTBOX_DIR, a folder this "
                             "process may write)") from None
    await outbox.flush(timeout_s)


async def say_once(outbox: EventOutbox, event: EventEnvelope, timeout_s: float) -> bool:
    """Record `event` and wait up to `timeout_s` for it to be stored; False when it was not yet (it is kept: written
    while the process lives, else by the node's next shard host), or when the outbox had no room for it in time."""
    deadline = time.monotonic() + timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            await outbox.record(event)
    except TimeoutError:
        log.warning("%s %s not kept: the event outbox is full of events the broker has not taken", event.type,
                    event.event_id)
        return False
    return await outbox.flush(max(0.0, deadline - time.monotonic()))


async def say_once_alone(nc: NatsClient, event: EventEnvelope, *, folder: Path | None, node_id: str,
                         signing_key: MemberKey | None, timeout_s: float) -> bool:
    """`say_once` through an outbox of its own, for a process whose shard server has stopped (and closed its own)."""
    outbox = shard_outbox(nc, signing_key)
    await start_outbox(outbox, folder, node_id, timeout_s)
    try:
        return await say_once(outbox, event, timeout_s)
    finally:
        await outbox.stop(0.0)  # waited already: what is left is kept in the file
