"""Projects verification outcomes (the `integrity.*` events of spot-checks) into each shard's reputation and evidence.

One handler per event type, dispatched by `apply_reputation_event`; they edit dict rows through the same
get/edit/put interface as readmodels.batch_rows.BatchRows, so `ReputationLog` (plain dicts, no database) lets a
reader of the log (`hearth-replay shard`) reach exactly the status the read model holds.

Rules: a confirmed mismatch quarantines the shard it names (its witnesses, two parties that agreed, are not
blamed), and while it is quarantined its node's other shards are not routed either (routing reads that from these
rows: hearth/readmodels/queries.py; hearth/protocol/quarantine.py words it), unless its reporter's earlier
accusations already hold MAX_NODES_HELD_PER_REPORTER other nodes (then it is kept as `unheld` evidence and counted,
and quarantines nobody: one member's word reaches that far, no further); a disputed one counts against both shards
and quarantines nobody; a steward's clearing lifts a quarantine unless it is older than the quarantine (a
re-published old clearing is history, not news); a mismatch event applied twice (re-published after the broker's
de-duplication window) counts once, since its evidence row exists. Every value comes from the events (instants
from `occurred_at`), all from one stream.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from functools import singledispatch
from typing import Any, Protocol

from sqlalchemy import Table

from hearth.events.models import (
    EventEnvelope,
    IntegrityMismatchConfirmed,
    IntegrityMismatchDisputed,
    IntegrityQuarantineCleared,
    IntegrityShardsVerified,
)
from hearth.protocol.quarantine import MAX_NODES_HELD_PER_REPORTER, held_node
from hearth.protocol.subjects import node_of_shard
from hearth.readmodels.batch_rows import INTEGRITY_EVIDENCE, SHARD_REPUTATION, Row, saturating_add

QUARANTINED = "quarantined"
ReputationEvent = IntegrityShardsVerified | IntegrityMismatchConfirmed | IntegrityMismatchDisputed | \
    IntegrityQuarantineCleared
MismatchEvent = IntegrityMismatchConfirmed | IntegrityMismatchDisputed


class Rows(Protocol):
    """The row store a handler edits (readmodels.batch_rows.BatchRows, or ReputationLog)."""

    def get(self, table: Table, key: Any) -> Row | None: ...

    def edit(self, table: Table, key: Any, new_row: Callable[[], Row] | None = None) -> Row | None: ...

    def put(self, table: Table, key: Any, row: Row) -> None: ...

    def where(self, table: Table, column: str, value: Any) -> list[Row]: ...


def mismatch_summary(mismatch: MismatchEvent | Row) -> str:
    """One line of evidence: layers, scheme, the position and step, the error against the tolerance, the digest."""
    value = mismatch if isinstance(mismatch, dict) else mismatch.model_dump()
    return (f"layers {value['layer_lo']}-{value['layer_hi']} ({value['quantization']}, {value['dtype']}) "
            f"{value['step_kind']} position {value['position']}: relative error {value['relative_error']:.3g} > "
            f"tolerance {value['tolerance']:.3g}, evidence sha256 {value['evidence_sha256']}")


def _epoch_s(event: EventEnvelope) -> int:
    return math.floor(event.occurred_at.timestamp())


def _reputation(rows: Rows, shard_id: str, at: int) -> Row:
    row = rows.edit(SHARD_REPUTATION, shard_id, lambda: dict(
        shard_id=shard_id, node_id=node_of_shard(shard_id), checks=0, verified_positions=0, mismatches=0,
        disputes=0, status="ok", status_since=None, status_event_id=None, status_reason=None, updated_at=at,
        first_event_at=at, quarantined_by=None,
    ))
    assert row is not None  # created by the factory when missing
    row["updated_at"] = at
    # When its sums began: a diff against a log that dropped older outcomes compares only rows it holds whole.
    row["first_event_at"] = min(row["first_event_at"], at)
    return row


def _record_evidence(rows: Rows, event: MismatchEvent, shard_id: str, kind: str, witnesses: list[str]) -> bool:
    """Store the evidence row of `shard_id` in `event`; False when it is already there (the event applied twice)."""
    key = (shard_id, event.event_id)
    if rows.get(INTEGRITY_EVIDENCE, key) is not None:
        return False
    rows.put(INTEGRITY_EVIDENCE, key, dict(
        shard_id=shard_id, event_id=event.event_id, kind=kind, pipeline_id=event.pipeline_id,
        reported_by=event.node_id, witnesses=json.dumps(witnesses), layer_lo=event.layer_lo,
        layer_hi=event.layer_hi, quantization=event.quantization, dtype=event.dtype, position=event.position,
        step_kind=event.step_kind, relative_error=event.relative_error, tolerance=event.tolerance,
        evidence_sha256=event.evidence_sha256, occurred_at=_epoch_s(event),
    ))
    return True


@singledispatch
def apply_reputation_event(event: EventEnvelope, rows: Rows) -> None:
    """Apply one verification outcome to the reputation rows (other events change nothing here)."""


@apply_reputation_event.register
def _shards_verified(event: IntegrityShardsVerified, rows: Rows) -> None:
    at = _epoch_s(event)
    for verified in event.shards:
        row = _reputation(rows, verified.shard_id, at)
        row["checks"] = saturating_add(row["checks"], verified.checks)
        row["verified_positions"] = saturating_add(row["verified_positions"], verified.verified_positions)


def nodes_held_by(rows: Rows, reporter: str) -> set[str]:
    """The nodes that quarantines on `reporter`'s word hold now."""
    return {held_node(row["shard_id"]) for row in rows.where(SHARD_REPUTATION, "quarantined_by", reporter)
            if row["status"] == QUARANTINED}


def _holds(rows: Rows, reporter: str, shard_id: str) -> bool:
    """Whether `reporter`'s accusation of `shard_id` quarantines it: its node is one the reporter's word already
    holds, or that word holds fewer than MAX_NODES_HELD_PER_REPORTER nodes."""
    held = nodes_held_by(rows, reporter)
    return held_node(shard_id) in held or len(held) < MAX_NODES_HELD_PER_REPORTER


@apply_reputation_event.register
def _mismatch_confirmed(event: IntegrityMismatchConfirmed, rows: Rows) -> None:
    current = rows.get(SHARD_REPUTATION, event.shard_id)
    # The first confirmed mismatch is the one a steward reads; later ones only count.
    held_already = current is not None and current["status"] == QUARANTINED
    quarantines = not held_already and _holds(rows, event.node_id, event.shard_id)
    kind = "confirmed" if quarantines or held_already else "unheld"
    if not _record_evidence(rows, event, event.shard_id, kind, list(event.witnesses)):
        return
    at = _epoch_s(event)
    row = _reputation(rows, event.shard_id, at)
    row["mismatches"] += 1
    if quarantines:
        row.update(status=QUARANTINED, status_since=at, status_event_id=event.event_id, quarantined_by=event.node_id,
                   status_reason=f"{mismatch_summary(event)}; witnesses {', '.join(event.witnesses)}; "
                                 f"pipeline {event.pipeline_id}; reported by {event.node_id}")


@apply_reputation_event.register
def _mismatch_disputed(event: IntegrityMismatchDisputed, rows: Rows) -> None:
    at = _epoch_s(event)
    for shard_id in dict.fromkeys(event.shard_ids):
        others = [other for other in event.shard_ids if other != shard_id]
        if _record_evidence(rows, event, shard_id, "disputed", others):
            _reputation(rows, shard_id, at)["disputes"] += 1


@apply_reputation_event.register
def _quarantine_cleared(event: IntegrityQuarantineCleared, rows: Rows) -> None:
    row = rows.get(SHARD_REPUTATION, event.shard_id)
    at = _epoch_s(event)
    if row is None or row["status"] != QUARANTINED or (row["status_since"] or 0) > at:
        return
    row = _reputation(rows, event.shard_id, at)
    row.update(status="ok", status_since=at, status_event_id=event.event_id, status_reason=event.reason,
               quarantined_by=None)


class ReputationLog:
    """The reputation rows of a sequence of events held in plain dicts: what the read model would hold."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[Any, Row]] = {SHARD_REPUTATION.name: {}, INTEGRITY_EVIDENCE.name: {}}

    def get(self, table: Table, key: Any) -> Row | None:
        return self._rows[table.name].get(key)

    def edit(self, table: Table, key: Any, new_row: Callable[[], Row] | None = None) -> Row | None:
        row = self._rows[table.name].get(key)
        if row is None and new_row is not None:
            row = self._rows[table.name][key] = new_row()
        return row

    def put(self, table: Table, key: Any, row: Row) -> None:
        self._rows[table.name][key] = row

    def where(self, table: Table, column: str, value: Any) -> list[Row]:
        return [row for row in self._rows[table.name].values() if row[column] == value]

    def apply(self, event: EventEnvelope) -> None:
        apply_reputation_event(event, self)

    def reputation(self, shard_id: str) -> Row | None:
        return self.get(SHARD_REPUTATION, shard_id)

    def quarantined_shards(self) -> list[str]:
        return [shard_id for shard_id, row in self._rows[SHARD_REPUTATION.name].items() if row["status"] == QUARANTINED]

    def evidence(self, shard_id: str) -> list[Row]:
        """The shard's evidence rows in the order they were applied."""
        return [row for (shard, _), row in self._rows[INTEGRITY_EVIDENCE.name].items() if shard == shard_id]
