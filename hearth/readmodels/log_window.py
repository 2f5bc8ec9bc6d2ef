"""Which rows of a read model hold what the event log no longer stores: rows older than the first message each
stream still keeps, which a rebuild cannot make, so a diff of a rebuild against a live read model leaves them out.

A stream that still holds its first message (sequence 1) has lost nothing and leaves nothing out. Otherwise its
window starts after the second in which the broker stored the oldest message it keeps, and each table's rule below
says which of its rows began before that: history by its own time (a minute, a day, a call's first event), the
counters summed over a shard's life (shard_stats, shard_reputation) by the earliest event summed into them, and a
shard's latest heartbeat total (shard_stats.tokens_served) by that heartbeat, which shard_health keeps.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text

from hearth.events.consume import SkippedMessage, StoredEvent
from hearth.events.streams import PIPELINES_STREAM, SHARDS_STREAM


@dataclass(frozen=True)
class OlderThanLogRule:
    """Rows of `table` matching `older` (SQL over `:start`, epoch s, and `:stream`) began before `stream`'s window."""

    table: str
    stream: str
    older: str


_CALL_BEGAN = "MIN(COALESCE(constructed_at, updated_at), COALESCE(first_token_at, updated_at))"

OLDER_THAN_LOG_RULES: tuple[OlderThanLogRule, ...] = (
    OlderThanLogRule("shards", SHARDS_STREAM, "advertised_at < :start"),
    OlderThanLogRule("shard_health", SHARDS_STREAM, "last_seen < :start"),
    # A bucket (minute, day) that began before the window holds a part the log dropped.
    OlderThanLogRule("event_counts", SHARDS_STREAM, "minute < :start AND type LIKE 'shard.%'"),
    OlderThanLogRule("event_counts", PIPELINES_STREAM, "minute < :start AND type NOT LIKE 'shard.%'"),
    # A member's removal (or key rotation) is published in both streams, and its minute sums both copies.
    OlderThanLogRule("event_counts", SHARDS_STREAM, "minute < :start AND type LIKE 'member.%'"),
    OlderThanLogRule("pipelines", PIPELINES_STREAM, f"{_CALL_BEGAN} < :start"),
    OlderThanLogRule("failovers", PIPELINES_STREAM, "occurred_at < :start OR pipeline_id IN (SELECT pipeline_id FROM "
                     f"pipelines WHERE {_CALL_BEGAN} < :start)"),
    OlderThanLogRule("pipeline_minutes", PIPELINES_STREAM, "minute < :start"),
    OlderThanLogRule("integrity_evidence", PIPELINES_STREAM, "occurred_at < :start"),
    # A sum that began before the window lacks what the log dropped (0: began before that time was recorded).
    OlderThanLogRule("shard_reputation", PIPELINES_STREAM, "first_event_at < :start"),
    OlderThanLogRule("shard_stats", PIPELINES_STREAM, "first_counted_at < :start"),
    # What a row holds from the shards stream (a heartbeat's total, or the row itself when no call counted on it)
    # is its latest heartbeat's: gone once that is older than the window.
    OlderThanLogRule("shard_stats", SHARDS_STREAM, "(tokens_served != 0 OR last_counted_at IS NULL) AND shard_id "
                     "NOT IN (SELECT shard_id FROM shard_health WHERE last_seen >= :start)"),
    OlderThanLogRule("host_tokens_daily", PIPELINES_STREAM, "day < :start"),
    OlderThanLogRule("kept_prefixes", PIPELINES_STREAM, "kept_at < :start"),
    *(OlderThanLogRule(table, stream, f"stream = :stream AND {column} < :start")
      for stream in (SHARDS_STREAM, PIPELINES_STREAM)
      for table, column in (("rejected_events", "rejected_at"), ("rejected_event_counts", "minute"),
                            ("member_removals", "removed_at"), ("steward_keys", "rotated_at"),
                            ("member_keys", "rotated_at"), ("member_additions", "added_at"),
                            ("applied_events", "occurred_at"))),
)


# A row written before a column was recorded holds a mark there (set by the migration that added it): its value is
# unknown, so a diff does not compare that column where either row holds the mark. When a row's sums began
# (migration 0014: a row summed before holds 0), a completed call's verification (migration 0020), the mesh
# protocol a shard advertised (migration 0022: NULL until its next advertisement, as for a shard of a hearth from
# before protocol versions, whose rebuilt row holds NULL too) and how far a shard's latest heartbeat was dated off
# the broker's clock (migration 0023: NULL until its next heartbeat).
sums_began_unrecorded = 0
verification_unrecorded = "unrecorded"
UNRECORDED_MARKS: dict[str, dict[str, Any]] = {
    "shards": {"protocol": None},
    "shard_health": {"clock_skew_s": None},
    "shard_stats": {"first_counted_at": sums_began_unrecorded},
    "shard_reputation": {"first_event_at": sums_began_unrecorded},
    "pipelines": {"verification": verification_unrecorded},
}


def compared_columns(table: str, new_row: Mapping[str, Any], live_row: Mapping[str, Any]) -> tuple[str, ...]:
    """The columns whose values differ between two rows of `table` with one key, leaving out those either row holds
    the unrecorded mark in."""
    marks = UNRECORDED_MARKS.get(table, {})
    unknown = {column for column, mark in marks.items() if mark in (new_row.get(column), live_row.get(column))}
    return tuple(column for column in new_row if column not in unknown and new_row[column] != live_row.get(column))


def window_start(first: StoredEvent | SkippedMessage | None, last_seq: int) -> int | None:
    """Where a stream's window starts (epoch s) given the first message read of it and its last sequence before the
    read; None while it still holds everything it stored."""
    if first is None:
        # Every message it stored aged out: the log holds nothing from before now.
        return None if last_seq == 0 else int(time.time())
    # Rows keep whole seconds: one in the oldest message's second may hold an earlier message of that second.
    return None if first.seq == 1 else int(first.time.timestamp()) + 1


def keys_older_than_log(connection: Any, table: str, key_columns: list[str], starts: Mapping[str, int]
                        ) -> set[tuple]:
    """The keys of `table`'s rows that began before their stream's window (`starts`: streams that dropped any)."""
    keys: set[tuple] = set()
    for rule in OLDER_THAN_LOG_RULES:
        if rule.table != table or rule.stream not in starts:
            continue
        rows = connection.execute(text(f"SELECT {', '.join(key_columns)} FROM {table} WHERE {rule.older}"),
                                  dict(start=starts[rule.stream], stream=rule.stream))
        keys.update(tuple(row) for row in rows)
    return keys
