"""SQLAlchemy declarative tables of the read models (docs/design.md §4); the schema is created only by Alembic.

Conventions, chosen so Grafana's SQLite datasource can read the tables directly:
- instants are INTEGER epoch seconds (floored), or epoch milliseconds in a column named `*_at_ms`;
  other `*_ms` columns are durations in milliseconds (`construct_ms`, `ttft_ms`, `p95_latency_ms`);
- lists of shard ids (hops) are JSON text;
- every value is derived from event contents (never the wall clock), so a replay gives identical rows.
"""

from __future__ import annotations

from sqlalchemy import Float, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

# The tables of what a projection admits live in their own module; imported here so that every table is on
# Base.metadata (what Alembic and a rebuild read) and importable from this one place.
from hearth.readmodels.admission_tables import (  # noqa: F401
    AppliedEvent,
    MemberAddition,
    MemberKey,
    MemberRemoval,
    RejectedEvent,
    RejectedEventCount,
    StewardKey,
)
from hearth.readmodels.table_base import Base, naming_convention  # noqa: F401

class Shard(Base):
    """One advertised layer range of one model on one node; withdrawn rows are kept for the audit trail."""

    __tablename__ = "shards"

    shard_id: Mapped[str] = mapped_column(String, primary_key=True)
    model_id: Mapped[str] = mapped_column(String, nullable=False)
    weights_sha256: Mapped[str] = mapped_column(String, nullable=False)
    node_id: Mapped[str] = mapped_column(String, nullable=False)
    layer_lo: Mapped[int] = mapped_column(Integer, nullable=False)
    layer_hi: Mapped[int] = mapped_column(Integer, nullable=False, comment="inclusive")
    total_layers: Mapped[int] = mapped_column(Integer, nullable=False)
    dtype: Mapped[str] = mapped_column(String, nullable=False)
    quantization: Mapped[str] = mapped_column(
        String, nullable=False, server_default="none", comment="weight quantization scheme: none | int8 | int4/gN")
    protocol: Mapped[int | None] = mapped_column(
        Integer, nullable=True, comment="mesh protocol it speaks (NULL: a hearth from before protocol versions)")
    memory_required_mb: Mapped[float] = mapped_column(Float, nullable=False)
    max_concurrent_streams: Mapped[int] = mapped_column(Integer, nullable=False)
    control_subject: Mapped[str] = mapped_column(String, nullable=False)
    hop_weight: Mapped[float] = mapped_column(Float, nullable=False)
    ttl_s: Mapped[float] = mapped_column(Float, nullable=False)
    status: Mapped[str] = mapped_column(String, nullable=False, comment="advertised | withdrawn")
    advertised_at: Mapped[int] = mapped_column(Integer, nullable=False, comment="epoch s")
    expires_at: Mapped[int] = mapped_column(Integer, nullable=False, comment="epoch s, advertised_at + ttl_s")
    withdrawn_at: Mapped[int | None] = mapped_column(Integer, comment="epoch s")
    withdrawn_reason: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (Index(None, "model_id", "status"),)


class ShardHealth(Base):
    """The latest heartbeat of each shard."""

    __tablename__ = "shard_health"

    shard_id: Mapped[str] = mapped_column(String, primary_key=True)
    last_seen: Mapped[int] = mapped_column(Integer, nullable=False, comment="epoch s of the latest heartbeat")
    queue_depth: Mapped[int] = mapped_column(Integer, nullable=False)
    active_streams: Mapped[int] = mapped_column(Integer, nullable=False)
    p95_latency_ms: Mapped[float] = mapped_column(Float, nullable=False, comment="duration")
    tokens_served_total: Mapped[int] = mapped_column(Integer, nullable=False)
    decode_step_ms: Mapped[float | None] = mapped_column(
        Float, comment="duration: median decode step over the shard's range (NULL: not measured yet)")
    heartbeat_id: Mapped[str | None] = mapped_column(
        String, comment="event id of the heartbeat the row states (NULL: written before 0019)")
    clock_skew_s: Mapped[int | None] = mapped_column(
        Integer, comment="duration: its latest heartbeat's date less when the broker stored it, one rejected "
                         "future_dated included (NULL: written before 0023)")


class Pipeline(Base):
    """One chat call's pipeline, from construction to its end (completed, aborted or fallen back to local)."""

    __tablename__ = "pipelines"

    pipeline_id: Mapped[str] = mapped_column(String, primary_key=True)
    request_id: Mapped[str | None] = mapped_column(String)
    model_id: Mapped[str | None] = mapped_column(String)
    weights_sha256: Mapped[str | None] = mapped_column(String)
    orchestrator_node_id: Mapped[str] = mapped_column(String, nullable=False)
    status: Mapped[str] = mapped_column(
        String, nullable=False,
        comment="constructed | streaming | degraded | fallback_local | completed | aborted",
    )
    hops: Mapped[str] = mapped_column(Text, nullable=False, comment="JSON list of shard_ids, current hops")
    construct_ms: Mapped[float | None] = mapped_column(Float, comment="duration")
    cached_prompt_tokens: Mapped[int | None] = mapped_column(
        Integer, comment="prompt positions its hops held from earlier calls (kept prefixes), not prefilled")
    ttft_ms: Mapped[float | None] = mapped_column(Float, comment="duration")
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    duration_ms: Mapped[float | None] = mapped_column(Float, comment="duration")
    tokens_per_second: Mapped[float | None] = mapped_column(Float)
    finish_reason: Mapped[str | None] = mapped_column(String)
    verification: Mapped[str | None] = mapped_column(
        String, comment="met | unmet: its hops checked as its verify level asks (NULL: none or "
                        "not ended; unrecorded: completed before migration 0020)")
    failovers: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    fell_back_to_local: Mapped[int] = mapped_column(Integer, nullable=False, default=0, comment="0/1")
    fallback_reason: Mapped[str | None] = mapped_column(Text)
    last_shard_status: Mapped[str | None] = mapped_column(String, comment="degraded | healthy")
    last_shard_status_shard_id: Mapped[str | None] = mapped_column(String)
    error_code: Mapped[str | None] = mapped_column(String)
    error_reason: Mapped[str | None] = mapped_column(Text)
    constructed_at: Mapped[int | None] = mapped_column(Integer, comment="epoch s")
    first_token_at: Mapped[int | None] = mapped_column(Integer, comment="epoch s")
    finished_at: Mapped[int | None] = mapped_column(Integer, comment="epoch s")
    updated_at: Mapped[int] = mapped_column(Integer, nullable=False, comment="epoch s of the latest event")

    # The second index covers every dashboard query over a time range of pipelines
    # (hearth/services/dashboards/panels.py) so those read no table rows: one index to maintain, instead of one per
    # panel. The third covers the checked calls of a range by model (the unmet-verification panel).
    __table_args__ = (
        Index(None, "status"),
        Index(None, "constructed_at", "status", "error_code", "fell_back_to_local", "ttft_ms", "tokens_per_second"),
        Index(None, "verification", "constructed_at", "model_id"),
    )


class Failover(Base):
    """The n-th failover (1-based) of one pipeline."""

    __tablename__ = "failovers"

    pipeline_id: Mapped[str] = mapped_column(String, primary_key=True)
    n: Mapped[int] = mapped_column(Integer, primary_key=True)
    failed_shard_id: Mapped[str] = mapped_column(String, nullable=False)
    replacement_hops: Mapped[str] = mapped_column(Text, nullable=False, comment="JSON list of shard_ids")
    reason: Mapped[str] = mapped_column(Text, nullable=False)
    resumed_at_token: Mapped[int] = mapped_column(Integer, nullable=False)
    occurred_at: Mapped[int] = mapped_column(Integer, nullable=False, comment="epoch s")

    __table_args__ = (Index(None, "occurred_at"),)


class ShardStats(Base):
    """Per-shard reputation counters.

    `tokens_served` comes from the shards stream, the other counters from the pipelines stream; each column
    is written from one stream only, so the rows do not depend on how the two streams interleave.
    """

    __tablename__ = "shard_stats"

    shard_id: Mapped[str] = mapped_column(String, primary_key=True)
    tokens_served: Mapped[int] = mapped_column(
        Integer, nullable=False, default=0, comment="tokens_served_total of the latest heartbeat"
    )
    pipelines_joined: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    failovers_caused: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    corruption_detections: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    last_counted_at: Mapped[int | None] = mapped_column(
        Integer, comment="epoch s of the latest pipelines-stream event counted on it (NULL: none yet)")
    first_counted_at: Mapped[int | None] = mapped_column(
        Integer, comment="epoch s of the earliest pipelines-stream event counted on it (NULL: none yet; 0: counted "
                         "before this was recorded)")


class ProjectionPosition(Base):
    """The last stream sequence a projection applied; written in the same transaction as the rows."""

    __tablename__ = "projection_positions"

    projection: Mapped[str] = mapped_column(String, primary_key=True)
    stream: Mapped[str] = mapped_column(String, primary_key=True)
    last_seq: Mapped[int] = mapped_column(Integer, nullable=False)
    last_event_at: Mapped[int | None] = mapped_column(
        Integer, comment="epoch s the stream stored that message"
    )
    stream_created: Mapped[str | None] = mapped_column(
        String, comment="ISO 8601 UTC creation time of the stream, as the broker reports it"
    )


class EventCount(Base):
    """How many events of one type a projection applied per minute of their `occurred_at` (the Event log
    dashboard's events per type per minute). Rejected events are counted in rejected_events instead."""

    __tablename__ = "event_counts"

    minute: Mapped[int] = mapped_column(Integer, primary_key=True, comment="epoch s, a multiple of 60")
    type: Mapped[str] = mapped_column(String, primary_key=True)
    events: Mapped[int] = mapped_column(Integer, nullable=False)


class HostTokensDaily(Base):
    """Tokens (prompt + generated) of completed calls per host per UTC day, counted once on each host that held a
    hop finishing the call, however many of its hops that host held (two shard processes, or two ranges, on one
    node); a failed-over host's part is counted on its replacement's. The host is the node the shard id names."""

    __tablename__ = "host_tokens_daily"

    day: Mapped[int] = mapped_column(Integer, primary_key=True, comment="epoch s of 00:00 UTC that day")
    node_id: Mapped[str] = mapped_column(
        String, primary_key=True, comment="the node its hops' shard ids name (a shard id naming none: itself)")
    tokens: Mapped[int] = mapped_column(Integer, nullable=False)


class PipelineMinute(Base):
    """Calls per minute of `constructed_at` with their nearest-rank percentiles, recomputed from the pipelines
    rows of that minute whenever one of them changes (hearth/readmodels/pipeline_minutes.py): what the Pipelines
    dashboard draws, without sorting every call of its time range on each refresh."""

    __tablename__ = "pipeline_minutes"

    minute: Mapped[int] = mapped_column(Integer, primary_key=True, comment="epoch s, a multiple of 60")
    calls: Mapped[int] = mapped_column(Integer, nullable=False)
    ttft_p50_ms: Mapped[float | None] = mapped_column(Float, comment="duration")
    ttft_p95_ms: Mapped[float | None] = mapped_column(Float, comment="duration")
    tokens_per_second_p50: Mapped[float | None] = mapped_column(Float, comment="completed calls")
    tokens_per_second_p95: Mapped[float | None] = mapped_column(Float, comment="completed calls")


class ShardReputation(Base):
    """What verification says about each shard (hearth/readmodels/reputation.py): the work spot-checks confirmed, the
    mismatches blamed on it, and whether it is quarantined (never routed, nor any other shard of its node) until a
    steward clears it."""

    __tablename__ = "shard_reputation"

    shard_id: Mapped[str] = mapped_column(String, primary_key=True)
    node_id: Mapped[str | None] = mapped_column(String, comment="the host, from the shard id (NULL: not parsed)")
    checks: Mapped[int] = mapped_column(Integer, nullable=False, comment="checks that found nothing wrong")
    verified_positions: Mapped[int] = mapped_column(Integer, nullable=False, comment="positions they confirmed")
    mismatches: Mapped[int] = mapped_column(Integer, nullable=False, comment="confirmed against it")
    disputes: Mapped[int] = mapped_column(Integer, nullable=False, comment="disagreements nobody could settle")
    status: Mapped[str] = mapped_column(String, nullable=False, comment="ok | quarantined")
    status_since: Mapped[int | None] = mapped_column(
        Integer, comment="epoch s of the event that set the status (NULL: never quarantined)")
    status_event_id: Mapped[str | None] = mapped_column(
        String, comment="the confirming mismatch (quarantined) or the clearing (ok again)")
    status_reason: Mapped[str | None] = mapped_column(
        Text, comment="the evidence summary (quarantined) or the steward's reason (cleared)")
    updated_at: Mapped[int] = mapped_column(Integer, nullable=False, comment="epoch s of the latest event")
    first_event_at: Mapped[int] = mapped_column(
        Integer, nullable=False, server_default="0",
        comment="epoch s of the earliest event summed into it (0: summed before this was recorded)")
    quarantined_by: Mapped[str | None] = mapped_column(
        String, comment="the node whose confirmed mismatch quarantined it (NULL: not quarantined)")

    __table_args__ = (Index(None, "status"), Index(None, "quarantined_by"))


class IntegrityEvidence(Base):
    """One row per shard named by a confirmed or disputed mismatch: what was compared, where, by how much."""

    __tablename__ = "integrity_evidence"

    shard_id: Mapped[str] = mapped_column(String, primary_key=True)
    event_id: Mapped[str] = mapped_column(String, primary_key=True)
    kind: Mapped[str] = mapped_column(
        String, nullable=False,
        comment="confirmed | unheld (confirmed, but its reporter already held the most nodes) | disputed")
    pipeline_id: Mapped[str] = mapped_column(String, nullable=False)
    reported_by: Mapped[str] = mapped_column(String, nullable=False, comment="the orchestrator's node id")
    witnesses: Mapped[str] = mapped_column(
        Text, nullable=False,
        comment="JSON list of shard_ids: who agreed against it (confirmed) or the one it disagreed with (disputed)")
    layer_lo: Mapped[int] = mapped_column(Integer, nullable=False)
    layer_hi: Mapped[int] = mapped_column(Integer, nullable=False, comment="inclusive")
    quantization: Mapped[str] = mapped_column(String, nullable=False)
    dtype: Mapped[str] = mapped_column(String, nullable=False)
    position: Mapped[int] = mapped_column(Integer, nullable=False)
    step_kind: Mapped[str] = mapped_column(String, nullable=False, comment="prefill | decode | replay")
    relative_error: Mapped[float] = mapped_column(Float, nullable=False)
    tolerance: Mapped[float] = mapped_column(Float, nullable=False)
    evidence_sha256: Mapped[str] = mapped_column(String, nullable=False)
    occurred_at: Mapped[int] = mapped_column(Integer, nullable=False, comment="epoch s")


class KeptPrefixRecord(Base):
    """A block name that a chain's hops were asked to keep (a mark of `pipeline.completed`'s kept prefix), with how
    many blocks it closes: what routing looks a call's own block names up in, longest first. Only names are stored
    (digests of scoped token blocks: they tell that two calls began alike, never what they said); rows past their
    `expires_at` are useless (the hops dropped those blocks) and are pruned as later ones of the same signer come in,
    or by the retention once expired before the log's pipelines cutoff. A record is its signer's: routing reads only
    the rows its own member key signed, so a member that copies another's marks from the log into a completion of its
    own keeps a row beside that member's, never in its place. Each record of a name is its own row, keyed by when it
    was kept too, so one dated before another never replaces it (the name's latest kept names the chain)."""

    __tablename__ = "kept_prefixes"

    signer: Mapped[str] = mapped_column(
        String, primary_key=True, comment="public key that signed the event ('': unsigned, an open mesh)")
    name: Mapped[str] = mapped_column(String, primary_key=True, comment="128-bit block name, hex")
    pipeline_id: Mapped[str] = mapped_column(String, nullable=False)
    hops: Mapped[str] = mapped_column(
        Text, nullable=False, comment="JSON list of [shard_id, layer_lo, layer_hi] (inclusive), in chain order")
    blocks: Mapped[int] = mapped_column(Integer, nullable=False, comment="blocks kept up to and with this one")
    kept_at: Mapped[int] = mapped_column(Integer, primary_key=True, comment="epoch s")
    expires_at: Mapped[int] = mapped_column(
        Integer, nullable=False, comment="epoch s, kept_at + the hops' idle time for kept blocks")

    # Pruning goes by signer: a range of the expired among its records, against their latest kept_at (one index step).
    __table_args__ = (Index(None, "expires_at"), Index(None, "signer", "expires_at"), Index(None, "signer", "kept_at"))
