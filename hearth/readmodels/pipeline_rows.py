"""Projects the pipelines stream's events into a call's rows: its pipeline row (hops, status, timings, tokens),
its failovers, the tokens each host served a day, and the shards it counted for (readmodels.shard_rows).

One handler per event type, dispatched by `apply_pipeline_event` (readmodels.projection calls it). A pipeline's row
is created by whichever of its events comes first, so a call whose earlier events aged out of the log still has one.
"""

from __future__ import annotations

import json
from functools import singledispatch
from typing import Any

from hearth.events.models import (
    UNVERIFIED_REPORT,
    EventEnvelope,
    PipelineAborted,
    PipelineCompleted,
    PipelineConstructed,
    PipelineFailover,
    PipelineFallbackLocal,
    PipelineFirstToken,
    PipelineShardStatus,
)
from hearth.events.streams import seconds_per_day
from hearth.protocol.subjects import node_of_shard
from hearth.readmodels.batch_rows import (
    FAILOVERS,
    HOST_TOKENS_DAILY,
    PIPELINES,
    TABLE_SQL,
    BatchRows,
    Row,
    epoch_s,
    saturating_add,
)
from hearth.readmodels.kept_prefixes import record_kept_prefix
from hearth.readmodels.pipeline_hops import hops_after_failover
from hearth.readmodels.shard_rows import count_for_shards

PipelineEvent = (PipelineConstructed | PipelineFirstToken | PipelineShardStatus | PipelineFailover
                 | PipelineFallbackLocal | PipelineCompleted | PipelineAborted)
TERMINAL_PIPELINE_STATUSES = frozenset({"completed", "aborted"})


@singledispatch
def apply_pipeline_event(event: EventEnvelope, rows: BatchRows) -> None:
    """Edit the rows a pipeline event changes (one of PipelineEvent; the projection dispatches no other here)."""
    raise TypeError(f"no pipeline-row handler for {type(event).__name__}")


@apply_pipeline_event.register
def _pipeline_constructed(event: PipelineConstructed, rows: BatchRows) -> None:
    pipeline = _pipeline(rows, event)
    newly_joined = [shard_id for shard_id in dict.fromkeys(event.hops) if shard_id not in _hops(pipeline)]
    pipeline.update(
        request_id=event.request_id,
        model_id=event.model_id,
        weights_sha256=event.weights_sha256,
        orchestrator_node_id=event.node_id,
        construct_ms=event.construct_ms,
        cached_prompt_tokens=event.cached_prompt_tokens,
        constructed_at=epoch_s(event.occurred_at),
        hops=json.dumps(list(event.hops)),
    )
    _set_live_status(pipeline)
    count_for_shards(rows, newly_joined, "pipelines_joined", event)


@apply_pipeline_event.register
def _pipeline_first_token(event: PipelineFirstToken, rows: BatchRows) -> None:
    pipeline = _pipeline(rows, event)
    pipeline.update(ttft_ms=event.ttft_ms, first_token_at=epoch_s(event.occurred_at))
    _set_live_status(pipeline)


@apply_pipeline_event.register
def _pipeline_shard_status(event: PipelineShardStatus, rows: BatchRows) -> None:
    pipeline = _pipeline(rows, event)
    pipeline.update(last_shard_status=event.status, last_shard_status_shard_id=event.shard_id)
    _set_live_status(pipeline, degraded=event.status == "degraded")


@apply_pipeline_event.register
def _pipeline_failover(event: PipelineFailover, rows: BatchRows) -> None:
    pipeline = _pipeline(rows, event)
    current_hops = _hops(pipeline)
    pipeline["failovers"] += 1
    rows.put(FAILOVERS, (event.pipeline_id, pipeline["failovers"]), dict(
        pipeline_id=event.pipeline_id,
        n=pipeline["failovers"],
        failed_shard_id=event.failed_shard_id,
        replacement_hops=json.dumps(list(event.replacement_hops)),
        reason=event.reason,
        resumed_at_token=event.resumed_at_token,
        occurred_at=epoch_s(event.occurred_at),
    ))
    new_hops = hops_after_failover(current_hops, event.failed_shard_id, event.replacement_hops)
    pipeline["hops"] = json.dumps(new_hops)
    _set_live_status(pipeline)
    newly_joined = [s for s in dict.fromkeys(event.replacement_hops) if s not in current_hops]
    count_for_shards(rows, newly_joined, "pipelines_joined", event)
    if event.reason != UNVERIFIED_REPORT:  # a hop's unverified word about another blames nobody
        count_for_shards(rows, [event.failed_shard_id], "failovers_caused", event)


@apply_pipeline_event.register
def _pipeline_fallback_local(event: PipelineFallbackLocal, rows: BatchRows) -> None:
    pipeline = _pipeline(rows, event)
    pipeline.update(fell_back_to_local=1, fallback_reason=event.reason)
    if pipeline["status"] not in TERMINAL_PIPELINE_STATUSES:
        pipeline["status"] = "fallback_local"


@apply_pipeline_event.register
def _pipeline_completed(event: PipelineCompleted, rows: BatchRows) -> None:
    pipeline = _pipeline(rows, event)
    day = epoch_s(event.occurred_at) // seconds_per_day * seconds_per_day
    # Once per host, however many hops it held; the host from the shard id, not the shards row, so the pipelines
    # stream alone decides it (a rebuild gives the same rows whatever the two streams' interleaving).
    for node_id in dict.fromkeys(node_of_shard(shard_id) or shard_id for shard_id in _hops(pipeline)):
        tokens = rows.edit(HOST_TOKENS_DAILY, (day, node_id),
                           lambda node_id=node_id: dict(day=day, node_id=node_id, tokens=0))
        tokens["tokens"] = saturating_add(tokens["tokens"], event.prompt_tokens + event.completion_tokens)
    pipeline.update(
        status="completed",
        prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens,
        duration_ms=event.duration_ms,
        tokens_per_second=event.tokens_per_second,
        finish_reason=event.finish_reason,
        verification=event.verification,
        finished_at=epoch_s(event.occurred_at),
    )
    record_kept_prefix(event, rows)


@apply_pipeline_event.register
def _pipeline_aborted(event: PipelineAborted, rows: BatchRows) -> None:
    _pipeline(rows, event).update(
        status="aborted",
        error_code=event.code,
        error_reason=event.reason,
        finished_at=epoch_s(event.occurred_at),
    )


def _pipeline(rows: BatchRows, event: Any) -> Row:
    """The pipeline row of this event, created if an earlier event of it has aged out of the log."""

    def new_pipeline() -> Row:
        row: Row = {column: None for column in TABLE_SQL[PIPELINES.name].columns}
        row.update(
            pipeline_id=event.pipeline_id,
            orchestrator_node_id=event.node_id,
            status="constructed",
            hops="[]",
            failovers=0,
            fell_back_to_local=0,
        )
        return row

    pipeline = rows.edit(PIPELINES, event.pipeline_id, new_pipeline)
    pipeline["updated_at"] = epoch_s(event.occurred_at)
    return pipeline


def _set_live_status(pipeline: Row, *, degraded: bool = False) -> None:
    """Status of a pipeline that has not ended: degraded, streaming once a token came, else constructed."""
    if pipeline["status"] in TERMINAL_PIPELINE_STATUSES or pipeline["status"] == "fallback_local":
        return
    if degraded:
        pipeline["status"] = "degraded"
    else:
        pipeline["status"] = "streaming" if pipeline["first_token_at"] is not None else "constructed"


def _hops(pipeline: Row) -> list[str]:
    return json.loads(pipeline["hops"]) if pipeline["hops"] else []
