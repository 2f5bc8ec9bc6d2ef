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
    rows.kept_prefixes_recorded = True


def prune_expired_kept_prefixes(rows: BatchRows) -> None:
    """Delete the records that expired before the latest one kept (after `rows.flush()`, same transaction), once a
    batch brought any. Against the table's latest, not the batch's: the newest record is never deleted (it expires
    after it was kept), so that bound only grows, and what is left does not depend on where batches were cut (a
    rebuild's one batch leaves what the live projector's many did)."""
    if rows.kept_prefixes_recorded:
        table = KEPT_PREFIXES.name
        rows.cursor.execute(f"DELETE FROM {table} WHERE expires_at < (SELECT MAX(kept_at) FROM {table})")
        rows.kept_prefixes_recorded = False
