"""Retention of the read models: which rows are history, pruned once older than the policy allows by the log's own
clock, and the pruning itself, a few hundred rows per transaction (docs/design.md §4, "Retention").

The clock is each stream's: the time the broker stored the last message a projection applied from it
(projection_positions.last_event_at), never this machine's. A row is pruned once its own time, from the events, is
older than that minus the retention of its stream; a row that is state (a shard not long gone, a quarantine, a
kept prefix not expired) is never pruned for age. Every rule is a function of the rows and the positions alone and
what it deletes only stays deleted, so a rebuild pruned at the end holds what a projector pruned now and then does.
After each pass the pages it freed go back to the disk (db.release_free_pages), a bounded number per transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy.orm import Session

from hearth.events.streams import PIPELINES_STREAM, SHARDS_STREAM, seconds_per_day
from hearth.readmodels.batch_rows import session_cursor
from hearth.readmodels.db import damaged_file, release_free_pages
from hearth.readmodels.positions import POSITIONS

log = logging.getLogger(__name__)

seconds_per_minute = 60
# How long a cancelled pruner waits for its transaction under way (a few hundred rows) to end.
prune_finish_timeout_s = 10.0
# Applied event ids are kept this much past their stream's retention, the window beyond which a copy is too_old: a
# broker clock stepped back (a stream's leader moving to a machine whose clock is behind) cannot let one in between.
applied_ids_margin_s = 3600.0
# Free pages given back to the disk per transaction: a step short beside an applier's batch (2 MiB of 4 KiB pages).
release_step_pages = 500


@dataclass(frozen=True)
class RetentionPolicy:
    """How long the read models keep history ([readmodels] in the configuration, which holds the defaults)."""

    shards_retention_days: float
    pipelines_retention_days: float
    daily_totals_retention_days: float
    rejected_samples_per_minute: int
    prune_interval_s: float
    prune_batch_rows: int


def retention_policy(section: Any) -> RetentionPolicy:
    """The policy a configuration section names field by field (the `[readmodels]` settings)."""
    return RetentionPolicy(**{field.name: getattr(section, field.name) for field in fields(RetentionPolicy)})


@dataclass(frozen=True)
class PruneRule:
    """Rows of `table` matching `where` (SQL over `:cutoff`, epoch s, and `:stream`) go once older than the cutoff:
    the clock of `stream` less `retention(policy)` days, floored to `align_s`."""

    table: str
    stream: str
    where: str
    retention: Callable[[RetentionPolicy], float]
    align_s: int = seconds_per_minute
    row: str = "rowid"  # the columns that name a row (a table without a rowid: its key's)


def _shards(policy: RetentionPolicy) -> float:
    return policy.shards_retention_days


def _pipelines(policy: RetentionPolicy) -> float:
    return policy.pipelines_retention_days


def _daily_totals(policy: RetentionPolicy) -> float:
    return policy.daily_totals_retention_days


# Each stream's history retention: what a read model keeps of that stream, the ids of the events it applied included.
STREAM_RETENTION: dict[str, Callable[[RetentionPolicy], float]] = {SHARDS_STREAM: _shards, PIPELINES_STREAM: _pipelines}


def _ids_kept(retention: Callable[[RetentionPolicy], float]) -> Callable[[RetentionPolicy], float]:
    return lambda policy: retention(policy) + applied_ids_margin_s / seconds_per_day


def history_kept_s(policy: RetentionPolicy | None, stream: str) -> float | None:
    """How long (s, by the stream's clock) the read models keep `stream`'s history; None: for ever (no policy, or a
    stream no rule prunes)."""
    retention = None if policy is None else STREAM_RETENTION.get(stream)
    return None if retention is None else retention(policy) * seconds_per_day


_NOT_QUARANTINED = "shard_id NOT IN (SELECT shard_id FROM shard_reputation WHERE status = 'quarantined')"

# In order: a rule that reads another table (shard_health reads shards) comes after that table's own rule.
PRUNE_RULES: tuple[PruneRule, ...] = (
    # A shard withdrawn, or expired without a new advert, that long ago; a live one expires ahead of the clock.
    PruneRule("shards", SHARDS_STREAM, "MAX(expires_at, COALESCE(withdrawn_at, expires_at)) < :cutoff", _shards),
    PruneRule("shard_health", SHARDS_STREAM,
              "last_seen < :cutoff AND shard_id NOT IN (SELECT shard_id FROM shards)", _shards),
    PruneRule("event_counts", SHARDS_STREAM, "minute < :cutoff AND type LIKE 'shard.%'", _shards),
    PruneRule("event_counts", PIPELINES_STREAM, "minute < :cutoff AND type NOT LIKE 'shard.%'", _pipelines),
    # A call's row goes once nothing happened to it within the retention and its minute's rollup goes too.
    PruneRule("pipelines", PIPELINES_STREAM,
              "updated_at < :cutoff AND (constructed_at IS NULL OR constructed_at < :cutoff)", _pipelines),
    PruneRule("failovers", PIPELINES_STREAM, "occurred_at < :cutoff", _pipelines),
    PruneRule("pipeline_minutes", PIPELINES_STREAM, "minute < :cutoff", _pipelines),
    # The evidence of a quarantine in force stays while it is in force, whatever its age.
    PruneRule("integrity_evidence", PIPELINES_STREAM, f"occurred_at < :cutoff AND {_NOT_QUARANTINED}", _pipelines),
    PruneRule("shard_reputation", PIPELINES_STREAM, "status != 'quarantined' AND updated_at < :cutoff", _pipelines),
    # A shard's counters go with the shard, once no call counted on it within the retention either.
    PruneRule("shard_stats", PIPELINES_STREAM,
              "(last_counted_at IS NULL OR last_counted_at < :cutoff) AND shard_id NOT IN (SELECT shard_id FROM "
              "shards) AND shard_id NOT IN (SELECT shard_id FROM shard_health)", _pipelines),
    PruneRule("host_tokens_daily", PIPELINES_STREAM, "day < :cutoff", _daily_totals, align_s=seconds_per_day),
    # A kept record expired that long ago: its signer kept nothing since (a later record of its would have pruned it)
    # and the log no longer holds it. Deleting a signer's latest lowers its pruning bound, but a record applied later
    # that the latest would have pruned expired before it was kept, so before this cutoff too: the next pass takes it.
    PruneRule("kept_prefixes", PIPELINES_STREAM, "expires_at < :cutoff", _pipelines),
    *(PruneRule(table, stream, f"stream = :stream AND {column} < :cutoff", retention)
      for stream, retention in STREAM_RETENTION.items()
      for table, column in (("rejected_events", "rejected_at"), ("rejected_event_counts", "minute"))),
    # An applied event's id goes once a copy of it would be refused as too old anyway (readmodels.applied_events).
    *(PruneRule("applied_events", stream, "stream = :stream AND occurred_at < :cutoff", _ids_kept(retention),
                row="stream, occurred_at, event_id") for stream, retention in STREAM_RETENTION.items()),
)


def log_clocks(cursor: Any, projection: str) -> dict[str, int]:
    """Per stream, when the broker stored the last message the projection applied (streams never read: absent)."""
    cursor.execute(f"SELECT stream, last_event_at FROM {POSITIONS.name} WHERE projection = ? AND last_event_at "
                   "IS NOT NULL", (projection,))
    return dict(cursor.fetchall())


def cutoff_of(rule: PruneRule, policy: RetentionPolicy, clocks: dict[str, int]) -> int | None:
    """The instant (epoch s) before which the rule's rows go; None while its stream has not been read."""
    clock = clocks.get(rule.stream)
    if clock is None:
        return None
    cutoff = int(clock - rule.retention(policy) * seconds_per_day)
    return cutoff // rule.align_s * rule.align_s


def prune_once(session: Session, policy: RetentionPolicy, projection: str) -> int:
    """Delete at most `prune_batch_rows` rows of the first rule that has any to delete, in the session's transaction
    (the caller commits); how many went (0: nothing is left to prune)."""
    cursor = session_cursor(session)
    try:
        clocks = log_clocks(cursor, projection)
        for rule in PRUNE_RULES:
            cutoff = cutoff_of(rule, policy, clocks)
            if cutoff is None:
                continue
            cursor.execute(
                f"DELETE FROM {rule.table} WHERE ({rule.row}) IN (SELECT {rule.row} FROM {rule.table} "
                f"WHERE {rule.where} LIMIT :limit)",
                dict(cutoff=cutoff, stream=rule.stream, limit=policy.prune_batch_rows))
            if cursor.rowcount > 0:
                return cursor.rowcount
        return 0
    finally:
        cursor.close()


def prune_all(session_factory: Callable[[], Session], policy: RetentionPolicy, projection: str) -> int:
    """Prune until nothing is left, one short transaction per `prune_batch_rows` rows, then give the free pages back to
    the disk; how many rows went."""
    pruned = 0
    while True:
        with session_factory() as session, session.begin():
            deleted = prune_once(session, policy, projection)
        if deleted == 0:
            break
        pruned += deleted
    while release_step(session_factory) > 0:
        pass
    return pruned


def release_step(session_factory: Callable[[], Session]) -> int:
    """Give at most `release_step_pages` free pages back to the disk, in one transaction; how many went."""
    with session_factory() as session:
        return release_free_pages(session, release_step_pages)


async def keep_pruning(session_factory: Callable[[], Session], policy: RetentionPolicy, projection: str,
                       write_turn: asyncio.Lock, count: Callable[[int], None]) -> None:
    """Every `prune_interval_s`, prune until nothing is left, then give the free pages back to the disk (a live
    projector's task): each transaction holds `write_turn`, which the applier takes for each batch, so batches go on
    between them; `count(rows)` after each that pruned."""

    def prune_transaction() -> int:
        with session_factory() as session, session.begin():
            return prune_once(session, policy, projection)

    async def in_turn(transaction: Callable[[], int]) -> int:
        async with write_turn:
            return await _finished_even_if_cancelled(asyncio.to_thread(transaction))

    while True:
        await asyncio.sleep(policy.prune_interval_s)
        try:
            while (deleted := await in_turn(prune_transaction)) > 0:
                count(deleted)
            while await in_turn(functools.partial(release_step, session_factory)) > 0:
                pass
        except asyncio.CancelledError:
            raise
        except Exception as error:  # a busy or failing database: the next round tries again
            if damaged_file(None, error) is not None:  # no round can mend a damaged file: its projector stops
                raise
            log.exception("%s: pruning the read model failed; trying again in %.0f s", projection,
                          policy.prune_interval_s)


async def _finished_even_if_cancelled(work: Awaitable[int]) -> int:
    """`work`'s result; cancelled meanwhile, it still waits (at most prune_finish_timeout_s) for the transaction under
    way in its thread to end, so the write turn is not handed on, nor the engine disposed, while it writes."""
    running = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(prune_finish_timeout_s):
                await running
        raise
