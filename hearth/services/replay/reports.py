"""The two audit views of hearth-replay: one pipeline's timeline and one shard's life (advertised, gaps, withdrawn).

Both are pure functions over already-read events, so they are tested without a broker. Times come from
each event's `occurred_at` (the emitting node's clock): a pipeline's events all come from its
orchestrator and a shard's from its host, so differences within one report use one clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from hearth.events.consume import StoredEvent
from hearth.events.models import PipelineCompleted, ShardAdvertised, ShardHeartbeat, ShardWithdrawn
from hearth.events.streams import shards_max_msgs_per_subject
from hearth.protocol.display_text import display_text
from hearth.services.replay.render import format_time, summarize_event


def format_offset(seconds: float) -> str:
    return f"{'+' if seconds >= 0 else '-'}{abs(seconds):.3f}s"


def pipeline_timeline(pipeline_id: str, events: Sequence[StoredEvent]) -> list[str]:
    """One line per event of the pipeline, in log order, with its time relative to the first (+0.000s)."""
    if not events:
        return []
    start = events[0].event.occurred_at
    width = max(len(item.event.type) for item in events)
    lines = [f"pipeline {pipeline_id}: {len(events)} events from {format_time(start)}"]
    for item in events:
        event = item.event
        offset = (event.occurred_at - start).total_seconds()
        summary = summarize_event(event, exclude=frozenset({"pipeline_id"}))
        lines.append(f"{format_offset(offset):>10}  {event.type:<{width}}  {summary}".rstrip())
    return [display_text(line) for line in lines]  # members wrote parts of them: no escape takes effect


@dataclass(frozen=True)
class PipelineEnd:
    """How a pipeline's log says it ended: `completed`, `aborted`, `fallback_local` or `running` (no terminal event
    yet), and for a completed call whether its hops were checked as its verify level asks (None: `none`, or an
    orchestrator that does not say)."""

    outcome: str
    verification: str | None = None

    def __str__(self) -> str:
        return self.outcome if self.verification is None else f"{self.outcome}, verification {self.verification}"


def pipeline_end(events: Sequence[StoredEvent]) -> PipelineEnd:
    end = PipelineEnd("running")
    for item in events:
        event = item.event
        if isinstance(event, PipelineCompleted):
            end = PipelineEnd("completed", event.verification)
        elif event.type == "pipeline.aborted":
            end = PipelineEnd("aborted")
        elif event.type == "pipeline.fallback_local" and end.outcome == "running":
            end = PipelineEnd("fallback_local")
    return end


def pipeline_outcome(events: Sequence[StoredEvent]) -> str:
    """The table's outcome: `completed` (`completed, verification met` / `... unmet` when the call says),
    `aborted`, `fallback_local` or `running`."""
    return str(pipeline_end(events))


@dataclass(frozen=True)
class HeartbeatGap:
    """A stretch longer than the health timeout with no sign of life from a shard."""

    after: datetime
    before: datetime | None  # None: still silent when the report was made

    @property
    def seconds(self) -> float:
        return ((self.before or datetime.now(timezone.utc)) - self.after).total_seconds()


def heartbeat_gaps(
    events: Sequence[StoredEvent], health_timeout_s: float, *, now: datetime | None = None
) -> list[HeartbeatGap]:
    """Silences longer than `health_timeout_s` between signs of life (advertisements and heartbeats).

    A withdrawal ends the shard's life, so nothing after it is a gap; a shard that is neither withdrawn
    nor heard from within the timeout before `now` gets a trailing, open gap.
    """
    gaps: list[HeartbeatGap] = []
    last_alive: datetime | None = None
    for item in events:
        event = item.event
        if isinstance(event, ShardWithdrawn):
            last_alive = None
            continue
        if isinstance(event, (ShardAdvertised, ShardHeartbeat)):
            if last_alive is not None and (event.occurred_at - last_alive).total_seconds() > health_timeout_s:
                gaps.append(HeartbeatGap(after=last_alive, before=event.occurred_at))
            last_alive = event.occurred_at
    if now is not None and last_alive is not None and (now - last_alive).total_seconds() > health_timeout_s:
        gaps.append(HeartbeatGap(after=last_alive, before=None))
    return gaps


def shard_report(
    shard_label: str,
    events: Sequence[StoredEvent],
    health_timeout_s: float,
    *,
    now: datetime | None = None,
) -> list[str]:
    """Advertisements, heartbeat summary, gaps longer than the health timeout, and withdrawals of one shard."""
    if not events:
        return []
    start = events[0].event.occurred_at
    lines = [f"shard {shard_label}: {len(events)} events from {format_time(start)}"]
    gaps = heartbeat_gaps(events, health_timeout_s, now=now)
    gap_lines = {
        gap.before: f"gap       {gap.seconds:.1f}s without heartbeat (> {health_timeout_s:g}s) "
        f"after {format_time(gap.after)}"
        for gap in gaps
    }
    heartbeats_in_run = 0
    run_started: datetime | None = None
    last_heartbeat: ShardHeartbeat | None = None

    def flush_heartbeats() -> None:
        nonlocal heartbeats_in_run, run_started
        if heartbeats_in_run and last_heartbeat is not None:
            offset = format_offset((run_started - start).total_seconds())
            lines.append(
                f"{offset:>10}  heartbeat  x{heartbeats_in_run} until {format_time(last_heartbeat.occurred_at)}, "
                f"last: queue_depth={last_heartbeat.queue_depth} active_streams={last_heartbeat.active_streams} "
                f"p95_latency_ms={last_heartbeat.p95_latency_ms:g} "
                + (f"decode_step_ms={last_heartbeat.decode_step_ms:g} "
                   if last_heartbeat.decode_step_ms is not None else "")
                + f"tokens_served_total={last_heartbeat.tokens_served_total}"
            )
        heartbeats_in_run, run_started = 0, None

    heartbeats_total = 0
    for item in events:
        event = item.event
        if event.occurred_at in gap_lines:
            flush_heartbeats()
            lines.append(f"{format_offset((event.occurred_at - start).total_seconds()):>10}  "
                         + gap_lines.pop(event.occurred_at))
        if isinstance(event, ShardHeartbeat):
            heartbeats_total += 1
            heartbeats_in_run += 1
            run_started = run_started or event.occurred_at
            last_heartbeat = event
            continue
        flush_heartbeats()
        offset = format_offset((event.occurred_at - start).total_seconds())
        kind = event.type.split(".", 1)[1]
        lines.append(f"{offset:>10}  {kind:<9}  {summarize_event(event)} node={event.node_id}")
    flush_heartbeats()
    for gap_line in gap_lines.values():  # the open gap, still silent now
        lines.append(f"{'now':>10}  {gap_line}, still silent")
    if heartbeats_total >= shards_max_msgs_per_subject:
        lines.append(
            f"note: the stream keeps the last {shards_max_msgs_per_subject} heartbeats per shard; older ones are gone"
        )
    return lines
