"""Keeps `pipeline_minutes` (calls and time-to-first-token / tokens-per-second percentiles per minute) in step
with the pipelines rows, inside the projection's transaction.

After a batch writes its pipelines rows, every minute (of `constructed_at`) one of them belongs to is
recomputed whole from the pipelines of that minute (a few dozen rows). The last change to any call of a
minute therefore leaves that minute's row a function of the final pipelines rows, so a rebuild from the log
gives the same rows, whatever the batches. Percentiles are nearest rank: the smallest value with at least
p % of the values at or below it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from hearth.readmodels.tables import PipelineMinute

_TABLE = PipelineMinute.__tablename__
_SELECT_MINUTE = (
    "SELECT ttft_ms, CASE WHEN status = 'completed' THEN tokens_per_second END FROM pipelines "
    "WHERE constructed_at BETWEEN ? AND ?"
)
_REPLACE = (
    f"INSERT OR REPLACE INTO {_TABLE} (minute, calls, ttft_p50_ms, ttft_p95_ms, tokens_per_second_p50, "
    "tokens_per_second_p95) VALUES (?, ?, ?, ?, ?, ?)"
)


def nearest_rank(sorted_values: Sequence[float], fraction: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[max(0, math.ceil(fraction * len(sorted_values)) - 1)]


def refresh_minutes(cursor: Any, pipelines: Iterable[dict[str, Any]]) -> None:
    """Recompute the pipeline_minutes rows of the minutes these (just written) pipelines rows belong to."""
    minutes = sorted({row["constructed_at"] // 60 * 60 for row in pipelines if row["constructed_at"] is not None})
    for minute in minutes:
        cursor.execute(_SELECT_MINUTE, (minute, minute + 59))
        rows = cursor.fetchall()
        ttfts = sorted(ttft for ttft, _ in rows if ttft is not None)
        rates = sorted(rate for _, rate in rows if rate is not None)
        cursor.execute(_REPLACE, (minute, len(rows), nearest_rank(ttfts, 0.5), nearest_rank(ttfts, 0.95),
                                  nearest_rank(rates, 0.5), nearest_rank(rates, 0.95)))
