"""The kept_prefixes read model: which chain's hops keep which block names, from `pipeline.completed`'s kept prefix,
each record under the key that signed it, and the pruning that keeps the table to records whose blocks may still be
held.

Every record is its own row, keyed by (signer, name, kept_at): one dated before another of the same name (two
orchestrators of a member with clocks apart, a clock stepped back) never replaces it, so a signer's latest kept_at
in the table never goes down (that record expires after it was kept and so is never pruned against it). Pruning
follows event time, never the wall clock, and each signer's own: each batch deletes, of every signer whose records it
applied, the records that expired before that signer's latest was kept. A record is thus gone exactly when it expired
before the latest its signer kept, wherever batches were cut: a replay of the log leaves the same rows as the live
projector. An event may be dated ahead of when the broker stored it (by up to the verifier's `max_clock_skew_s`), so a
member whose clock runs ahead hurries out only its own records, never another member's; and routing, which skips rows
expired by its own clock, reads of a name its latest kept record. A signer that keeps nothing more leaves its last
records until the retention prunes them, once they expired before the log's pipelines cutoff
(hearth/readmodels/retention.py).
"""

from __future__ import annotations

import json
import math

from hearth.events.models import PipelineCompleted
from hearth.readmodels.batch_rows import KEPT_PREFIXES, BatchRows


# The signer column of records from unsigned events (an open mesh): a key column holds no NULL.
UNSIGNED_RECORDS = ""


def records_signer(keeper: str | None) -> str:
    """The signer column of the records `keeper` (a member's public key; None on an open mesh) signed."""
    return keeper or UNSIGNED_RECORDS


def record_kept_prefix(event: PipelineCompleted, rows: BatchRows) -> None:
    """A completed call's kept blocks, one row per mark under the event's signer (the projection applies a signed
    event only once it verified that key: admission.py) and when it was kept, beside the signer's other records of
    that name (only one kept in the same second replaces it, the later in the log's order); another member copying the
    mark from the log keeps its own row, which routing for this one never reads (a mark is drawn over the key of the
    member whose hops keep the blocks: hearth/services/orchestrator/prefix.py)."""
    kept = event.kept_prefix
    if kept is None:
        return
    signer = records_signer(event.signer)
    kept_at = math.floor(event.occurred_at.timestamp())
    hops = json.dumps([[hop.shard_id, hop.layer_lo, hop.layer_hi] for hop in kept.hops])
    expires_at = math.floor(event.occurred_at.timestamp() + kept.idle_s)
    for mark in kept.marks:
        rows.put(KEPT_PREFIXES, (signer, mark.name, kept_at), dict(
            signer=signer, name=mark.name, pipeline_id=event.pipeline_id, hops=hops, blocks=mark.blocks,
            kept_at=kept_at, expires_at=expires_at))
    rows.kept_prefix_signers.add(signer)


def prune_expired_kept_prefixes(rows: BatchRows) -> None:
    """Delete, of each signer whose records the batch brought (after `rows.flush()`, same transaction), the records
    that expired before that signer's latest one was kept. Against the table's latest of that signer, not the batch's:
    no record replaces one kept at another time and the latest is never deleted (it expires after it was kept), so
    the bound only grows, and what is left does not depend on where batches were cut (a rebuild's one batch leaves what
    the live projector's many did); a signer the batch brought nothing of was pruned against that same bound in the
    last batch that did."""
    if rows.kept_prefix_signers:
        table = KEPT_PREFIXES.name
        latest = f"SELECT MAX(kept_at) FROM {table} WHERE signer = ?"
        rows.cursor.executemany(f"DELETE FROM {table} WHERE signer = ? AND expires_at < ({latest})",
                                [(signer, signer) for signer in sorted(rows.kept_prefix_signers)])
        rows.kept_prefix_signers.clear()
