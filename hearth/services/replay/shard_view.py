"""`hearth-replay shard`: one shard's life (shards stream) and the verification evidence about it (integrity events
of the pipelines stream): checks, verified positions, each mismatch with its witnesses, position, error against
tolerance and digest, clearings, and the status the read model derives from them (hearth/readmodels/reputation.py),
and whether another shard of its node is quarantined (a quarantine holds the node: routing leaves this one out too).

Integrity events are addressed by pipeline, not by shard, so every outcome event is read and those naming the
shard are kept, with the mismatches and clearings of its node's other shards. Their times are the orchestrators'
(or the steward's) clocks, printed as instants. The stream's removals and key rotations are read with them, so a
removal, and a steward key the log names, count from where they stand in it, as in a projection.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from hearth.events.consume import StoredEvent
from hearth.events.models import (
    EventEnvelope,
    IntegrityMismatchConfirmed,
    IntegrityMismatchDisputed,
    IntegrityQuarantineCleared,
    IntegrityShardsVerified,
    MemberChange,
)
from hearth.events.logged_keys import LoggedKeys
from hearth.events.signing import EventVerifier
from hearth.protocol.display_text import display_text
from hearth.protocol.quarantine import node_quarantine_reason, unheld_reason
from hearth.protocol.subjects import EVENTS_PREFIX, node_of_shard, shard_key
from hearth.readmodels.reputation import QUARANTINED, ReputationLog, mismatch_summary, nodes_held_by
from hearth.services.replay.render import format_time
from hearth.services.replay.reports import shard_report

OUTCOME_KINDS = ("shards_verified", "mismatch_confirmed", "mismatch_disputed", "quarantine_cleared")


def names_shard(event: EventEnvelope, shard: str, key: str) -> bool:
    """Whether a verification outcome speaks about the shard given as `shard` (an id) or `key` (its shard_key)."""
    if isinstance(event, IntegrityShardsVerified):
        named = [verified.shard_id for verified in event.shards]
    elif isinstance(event, IntegrityMismatchConfirmed):
        named = [event.shard_id, *event.witnesses]
    elif isinstance(event, IntegrityMismatchDisputed):
        named = list(event.shard_ids)
    elif isinstance(event, IntegrityQuarantineCleared):
        named = [event.shard_id]
    else:
        return False
    return any(shard_id == shard or shard_key(shard_id) == key for shard_id in named)


def shapes_quarantines(event: EventEnvelope) -> bool:
    """Whether `event` may quarantine or free a shard (a confirmed mismatch, a clearing): what holds a shard's node,
    and how many nodes each reporter's word holds, which bounds whether its next accusation quarantines."""
    return isinstance(event, IntegrityMismatchConfirmed | IntegrityQuarantineCleared)


async def read_shard_log(js: Any, shard: str, key: str) -> tuple[list[StoredEvent], list[StoredEvent]]:
    """The shard's own events and the verification outcomes naming it or shaping quarantines, each in stream
    order."""
    from hearth.events.consume import read_stream
    from hearth.events.streams import MEMBER_REMOVAL_SUBJECTS, PIPELINES_STREAM, SHARDS_STREAM
    from hearth.protocol.subjects import shard_events_filter
    from hearth.services.replay.query import existing_streams

    present, _ = await existing_streams(js, [SHARDS_STREAM, PIPELINES_STREAM])
    own: list[StoredEvent] = []
    outcomes: list[StoredEvent] = []
    if SHARDS_STREAM in present:
        shard_filter = shard_events_filter(key)
        async with contextlib.aclosing(read_stream(js, SHARDS_STREAM, subject_filter=shard_filter)) as items:
            own = [item async for item in items if isinstance(item, StoredEvent)]
    if PIPELINES_STREAM in present:
        filters = [*(f"{EVENTS_PREFIX}.integrity.*.{kind}" for kind in OUTCOME_KINDS),
                   MEMBER_REMOVAL_SUBJECTS[PIPELINES_STREAM]]
        async with contextlib.aclosing(read_stream(js, PIPELINES_STREAM, subject_filter=filters)) as items:
            outcomes = [item async for item in items if isinstance(item, StoredEvent)
                        and (names_shard(item.event, shard, key) or shapes_quarantines(item.event)
                             or isinstance(item.event, MemberChange))]
    return own, outcomes


def _shard_id(shard: str, key: str, own: Sequence[StoredEvent], outcomes: Sequence[StoredEvent]) -> str:
    """The full shard id when `shard` was given as its key (found in its events), else `shard` itself."""
    if shard != key:
        return shard
    for item in own:
        return item.event.shard_id
    for item in outcomes:
        for candidate in _named(item.event):
            if shard_key(candidate) == key:
                return candidate
    return shard


def _named(event: EventEnvelope) -> list[str]:
    for attribute in ("shard_id", "shard_ids", "shards"):
        value = getattr(event, attribute, None)
        if isinstance(value, str):
            return [value]
        if value:
            return [getattr(item, "shard_id", item) for item in value]
    return []


def evidence_lines(shard_id: str, outcomes: Sequence[StoredEvent], verifier: EventVerifier | None = None) -> list[str]:
    """The reputation part of the view: totals, the status, then one line per mismatch, dispute and clearing, and
    the node's other quarantined shards (outcomes about those only are applied, not listed). With the community's
    `verifier` an event a projector would reject is listed as rejected and not applied."""
    log = ReputationLog()
    logged = LoggedKeys()
    details: list[str] = []
    calls_checked = naming = 0
    for item in outcomes:
        event = item.event
        when = f"  {format_time(event.occurred_at)}"
        rejection = logged.rejection(verifier, item) if verifier is not None else None
        if isinstance(event, MemberChange):  # not shown: it cuts a key off, names a key, or adds a member
            if rejection is None:
                logged.record(event)
            continue
        if not names_shard(event, shard_id, shard_key(shard_id)):
            if rejection is None:  # another shard's quarantine or clearing: it holds or frees this shard's node, or
                log.apply(event)  # counts towards its reporter's bound
            continue
        naming += 1
        if rejection is not None:
            details.append(f"{when}  REJECTED {event.type} {event.event_id} from {event.node_id} ({rejection}): "
                           "not applied, as a community's projector does not apply it")
            continue
        before = dict(log.reputation(shard_id) or {})
        reporters_hold = nodes_held_by(log, event.node_id)
        log.apply(event)
        after = log.reputation(shard_id) or {}
        if isinstance(event, IntegrityShardsVerified):
            calls_checked += any(verified.shard_id == shard_id for verified in event.shards)
        elif isinstance(event, IntegrityMismatchConfirmed) and event.shard_id == shard_id:
            unheld = before.get("status") != QUARANTINED and after.get("status") != QUARANTINED
            details.append(f"{when}  mismatch confirmed in pipeline {event.pipeline_id} (reported by {event.node_id}): "
                           f"{mismatch_summary(event)}; witnesses that agreed: {', '.join(event.witnesses)}"
                           + (f"; {unheld_reason(event.node_id, reporters_hold)}" if unheld else ""))
        elif isinstance(event, IntegrityMismatchConfirmed):
            details.append(f"{when}  witness against {event.shard_id} in pipeline {event.pipeline_id}")
        elif isinstance(event, IntegrityMismatchDisputed):
            other = ", ".join(s for s in event.shard_ids if s != shard_id)
            details.append(f"{when}  disputed with {other} in pipeline {event.pipeline_id} (nobody to break the tie): "
                           f"{mismatch_summary(event)}")
        elif isinstance(event, IntegrityQuarantineCleared):
            effect = "lifted the quarantine" if before.get("status") == QUARANTINED and after.get("status") == "ok" \
                else "changed nothing (not quarantined then, or older than the quarantine)"
            details.append(f"{when}  cleared by {event.node_id} (clearing {event.pipeline_id}): {event.reason!r}; "
                           f"{effect}")
    node = node_of_shard(shard_id)
    siblings = sorted(other for other in log.quarantined_shards() if other != shard_id and node_of_shard(other) == node)
    held = [f"routing: {node_quarantine_reason(node, siblings[0])}: no shard of {node} is routed while "
            f"{', '.join(siblings)} {'is' if len(siblings) == 1 else 'are'} quarantined"] if node and siblings else []
    row = log.reputation(shard_id)
    if row is None:
        witness = [f"verification: {naming} outcome events name it only as a witness"] + details if details else []
        return witness + held
    status = row["status"].upper() if row["status"] == QUARANTINED else row["status"]
    since = f" since {_instant(row['status_since'])} (event {row['status_event_id']})" if row["status_since"] else ""
    lines = [f"verification: status {status}{since}",
             f"  {row['checks']} checks found nothing wrong in {calls_checked} calls, {row['verified_positions']} "
             f"positions verified; {row['mismatches']} mismatches confirmed against it, {row['disputes']} disputed"]
    lines += details + held
    if row["status"] == QUARANTINED:
        lines.append(f"  a steward clears it: hearth community clear-quarantine '{shard_id}' --reason TEXT")
    return lines


def _instant(epoch_s: int) -> str:
    return format_time(datetime.fromtimestamp(epoch_s, timezone.utc))


def shard_view_lines(shard: str, key: str, own: Sequence[StoredEvent], outcomes: Sequence[StoredEvent],
                     health_timeout_s: float, *, now: datetime, verifier: EventVerifier | None = None) -> list[str]:
    """The whole `hearth-replay shard` output; empty when the log says nothing about the shard."""
    shard_id = _shard_id(shard, key, own, outcomes)
    lines = shard_report(f"{shard_id} (key {key})", own, health_timeout_s, now=now) if own else []
    if not own and outcomes:
        lines.append(f"shard {shard_id} (key {key}): no shard events left in the log")
    # Members wrote parts of them (ids, reasons): no escape of theirs takes effect on the terminal.
    return [display_text(line) for line in lines + evidence_lines(shard_id, outcomes, verifier)]
