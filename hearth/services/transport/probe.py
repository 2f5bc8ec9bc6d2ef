"""Whether a shard answers on its control subject: the liveness probe behind the stall watch's verdicts and a
restarted host's look at its node's earlier adverts."""

from __future__ import annotations

import enum
from typing import Protocol

from nats.aio.client import Client as NatsClient
from nats.errors import NoRespondersError

from hearth.events.cancellation import keeping_cancellation
from hearth.protocol.control import ShardStat, StatShard


class ProbeOutcome(enum.Enum):
    answered = "answered"
    no_responder = "no_responder"  # nothing subscribes to its control subject: the host is gone
    silent = "silent"  # no answer in time: frozen, overloaded, or the answer was lost


class Controlled(Protocol):
    """A shard as far as a probe needs it (a Hop, a read model's ShardCandidate, a shard's own identity)."""

    @property
    def control_subject(self) -> str: ...


async def probe_outcome(nc: NatsClient, shard: Controlled, timeout_s: float) -> ProbeOutcome:
    """How the shard reacts to `stat`: answers, has no responder (gone), or stays silent."""
    return (await probe_stat(nc, shard, timeout_s))[0]


async def probe_stat(nc: NatsClient, shard: Controlled, timeout_s: float) -> tuple[ProbeOutcome, ShardStat | None]:
    """probe_outcome, and the shard's answer when it answered (which pipelines it holds a hop of, among others)."""
    try:
        message = await keeping_cancellation(
            nc.request(shard.control_subject, StatShard().model_dump_json().encode(), timeout=timeout_s))
        stat = ShardStat.model_validate_json(message.data)
    except NoRespondersError:
        return ProbeOutcome.no_responder, None
    except Exception:  # a timeout, a closed connection, or an answer that is not a ShardStat
        return ProbeOutcome.silent, None
    return ProbeOutcome.answered, stat


def holds_no_hop_of(stat: ShardStat, pipeline_id: str) -> bool:
    """Whether a shard's `stat` says it holds no hop of `pipeline_id` (it closed it, or never opened it); False from a
    shard that does not say which it holds."""
    return "open_pipelines" in stat.model_fields_set and pipeline_id not in stat.open_pipelines
