"""The recovery policy: what a call does after a failure (a step's or its routing's), as one table read top to bottom.

| failure                                          | while                                     | decision           |
|--------------------------------------------------|-------------------------------------------|--------------------|
| routing found no chain                           | fallback allowed (config and request)     | fall back to local |
| routing found no chain                           | otherwise                                 | abort              |
| a hop's (or the local model's) session evicted   | re-prefills < max_eviction_reprefills     | re-prefill         |
| broker connection lost (no shard to blame)       | hops to reopen, repairs < max_broker_...  | rebuild            |
| broker connection lost, local session evicted    | otherwise                                 | abort (stalled)    |
| a shard failed (any other kind, evicted too)     | failovers < fallback_to_local_after_...   | fail over          |
| a shard failed                                   | otherwise, fallback allowed               | fall back to local |
| a shard failed                                   | otherwise                                 | abort              |

A shard failure's decision names the shard to route around (reported `degraded`, excluded for the rest of the call)
before it is carried out. The policy only decides: the call's loop (hearth/services/orchestrator/pipeline.py) carries
the decision out and counts what it did.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hearth.services.common.config import HearthSettings
from hearth.services.orchestrator.outcomes import Failure, RoutingFailure

# The abort code when a call runs out of shards (or failovers), and when the broker does not come back.
SHARD_UNAVAILABLE = "shard_unavailable"
PIPELINE_STALLED = "pipeline_stalled"


class Action(enum.Enum):
    reprefill = "re-prefill on the same chain"
    rebuild = "rebuild the same hops once the broker is back"
    fail_over = "fail over to a chain around the failed shard"
    fall_back = "fall back to a local model"
    abort = "abort"


@dataclass(frozen=True)
class Decision:
    action: Action
    # The shard to report degraded and route around for the rest of the call, before acting.
    route_around: str | None = None
    # The call's abort code and reason: for `abort`, and for `fall_back` when no local model can serve the call.
    code: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class RecoveryLimits:
    """The settings the policy reads."""

    max_eviction_reprefills: int
    fallback_to_local_after_failures: int
    max_broker_repairs: int
    fallback_to_local: bool

    @classmethod
    def from_settings(cls, settings: HearthSettings) -> "RecoveryLimits":
        distributed = settings.research.distributed_inference
        return cls(max_eviction_reprefills=distributed.max_eviction_reprefills,
                   fallback_to_local_after_failures=distributed.fallback_to_local_after_failures,
                   max_broker_repairs=settings.orchestrator.max_broker_repairs,
                   fallback_to_local=distributed.fallback_to_local)


@dataclass(frozen=True)
class CallCounters:
    """What the policy reads of the call: what it recovered from so far and what it allows."""

    eviction_reprefills: int = 0
    failovers: int = 0
    broker_repairs: int = 0
    # The request's own `fallback_to_local`.
    fallback_requested: bool = True
    # Whether the failed chain had remote hops that a rebuild could reopen.
    has_hops: bool = True


def decide(failure: Failure, call: CallCounters, limits: RecoveryLimits) -> Decision:
    """What the call does next after `failure` (the table in the module docstring, row by row)."""
    if isinstance(failure, RoutingFailure):
        if failure.replacing is None:
            return _fall_back_or_abort(failure.code, failure.message, call, limits)
        return _fall_back_or_abort(SHARD_UNAVAILABLE,
                                   f"no replacement for {failure.replacing.shard_id}: {failure.message}", call, limits)
    if failure.kind == "evicted" and call.eviction_reprefills < limits.max_eviction_reprefills:
        return Decision(Action.reprefill)
    if failure.shard_id is None:
        if call.has_hops and call.broker_repairs < limits.max_broker_repairs:
            return Decision(Action.rebuild)
        # A local chain's (its session evicted once too often) has no hops to rebuild.
        rebuilt = f" (rebuilt {call.broker_repairs} times)" if call.has_hops else ""
        return Decision(Action.abort, code=PIPELINE_STALLED, reason=f"{failure.reason}{rebuilt}")
    # `fallback_to_local_after_failures` failovers are allowed; the failure after them falls back.
    if call.failovers < limits.fallback_to_local_after_failures:
        return Decision(Action.fail_over, route_around=failure.shard_id)
    return _fall_back_or_abort(SHARD_UNAVAILABLE, f"{call.failovers} failovers; last: {failure}", call, limits,
                               route_around=failure.shard_id)


def _fall_back_or_abort(code: str, reason: str, call: CallCounters, limits: RecoveryLimits, *,
                        route_around: str | None = None) -> Decision:
    allowed = limits.fallback_to_local and call.fallback_requested
    return Decision(Action.fall_back if allowed else Action.abort, route_around=route_around, code=code,
                    reason=reason)
