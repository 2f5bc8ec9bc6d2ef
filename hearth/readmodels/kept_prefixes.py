"""The kept_prefixes read model: which chain's hops keep which block names, from `pipeline.completed`'s kept prefix,
and the pruning that keeps the table to records whose blocks may still be held.

Pruning follows event time, never the wall clock: each batch deletes the rows that expired before the latest record
it applied, so a replay of the log leaves the same rows (the newest records' `expires_at` is ahead of every record
still useful to routing, which also skips rows expired by its own clock).
"""

from __future__ import annotations

import json
import math

from hearth.events.models import PipelineCompleted
from hearth.readmodels.batch_rows import KEPT_PREFIXES, BatchRows


def record_kept_prefix(event: PipelineCompleted, rows: BatchRows) -> None:
    """A completed call's kept blocks, one row per mark (a later record of the same name replaces it)."""
    kept = event.kept_prefix
    if kept is None:
        return
    kept_at = math.floor(event.occurred_at.timestamp())
    hops = json.dumps([[hop.shard_id, hop.layer_lo, hop.layer_hi] for hop in kept.hops])
    expires_at = math.floor(event.occurred_at.timestamp() + kept.idle_s)
    for mark in kept.marks:
        rows.put(KEPT_PREFIXES, mark.name, dict(name=mark.name, pipeline_id=event.pipeline_id, hops=hops,
                                                blocks=mark.blocks, kept_at=kept_at, expires_at=expires_at))
    rows.kept_prefixes_seen_at = max(kept_at, rows.kept_prefixes_seen_at or kept_at)


def prune_expired_kept_prefixes(rows: BatchRows) -> None:
    """Delete the records that expired before the batch's latest one (after `rows.flush()`, same transaction)."""
    if rows.kept_prefixes_seen_at is not None:
        rows.cursor.execute(f"DELETE FROM {KEPT_PREFIXES.name} WHERE expires_at < ?", (rows.kept_prefixes_seen_at,))
        rows.kept_prefixes_seen_at = None
