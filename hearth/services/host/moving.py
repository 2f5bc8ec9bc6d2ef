"""What a `hearth host` says while it moves to another layer range: heartbeats of the range it left until the new
one is advertised, and, when a move will not land, the withdrawal telling the hosts waiting for it to decide again."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient

from hearth.events.models import ShardWithdrawn
from hearth.events.publish import publish_event
from hearth.services.common.config import HearthSettings
from hearth.services.common.event_trust import event_signing_key
from hearth.services.common.lifecycle import event_within
from hearth.services.host.planner import LayerRange
from hearth.services.shard.kept_events import say_once_alone, shard_outbox_dir
from hearth.services.shard.metrics import ServingStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Move:
    """A move decided and drained: the range to serve next, the shard left for it (withdrawn as MOVED) and the
    figures that shard served with (its heartbeats go on while the host moves: heartbeats_while_moving)."""

    to: LayerRange
    left: str
    served: ServingStats


async def heartbeats_while_moving(nc: NatsClient, settings: HearthSettings, node: str, move: Move,
                                  landed: asyncio.Event) -> None:
    """Heartbeats of the shard `move` left (withdrawn as MOVED: routing does not count it), with the figures it served
    with and no stream open, every `[shard] heartbeat_interval_s` from now until `landed` (the new range
    advertised): they say the host is still moving (it drains, then loads, perhaps fetching), and the hosts holding
    their own moves meanwhile (CoverageReader.move_under_way) go on once they stop, after the health timeout (the
    host was killed), not after `move_wait_max_s`. The drain's heartbeats are the shard's own (ShardServer)."""
    js, signing_key = nc.jetstream(), event_signing_key(settings.nats)
    while not landed.is_set():
        beat = move.served.heartbeat(node, move.left)
        try:  # publish_event keeps a cancellation that lands as its ack does (events.cancellation)
            await publish_event(js, beat, signing_key=signing_key)
        except Exception as error:  # the broker may be restarting; the next beat tries again
            log.warning("host %s: heartbeat of %s while moving not published: %s", node, move.left, error)
        await event_within(landed, settings.shard.heartbeat_interval_s)


async def say_move_abandoned(nc: NatsClient, settings: HearthSettings, withdrawal: ShardWithdrawn) -> bool:
    """Say `withdrawal`: a shard withdrawn as MOVED, withdrawn again as a shutdown: the move will not land (the host
    stops, or the new range did not load), and hosts waiting for it (CoverageReader.move_under_way) decide again
    now, not after `move_wait_max_s`. Whether the broker stored it within `[shard] withdraw_timeout_s`."""
    try:  # kept in the shard outbox until stored (said once): a broker gone now takes it later, from this node
        return await say_once_alone(nc, withdrawal, folder=shard_outbox_dir(settings),
                                    node_id=withdrawal.node_id, signing_key=event_signing_key(settings.nats),
                                    timeout_s=settings.shard.withdraw_timeout_s)
    except Exception as error:  # no outbox file: they wait at most move_wait_max_s then
        log.warning("host %s: could not say that its move from %s is abandoned: %s", withdrawal.node_id,
                    withdrawal.shard_id, error)
        return False
