"""Initial read-model schema: shards, shard_health, pipelines, failovers, shard_stats, projection_positions.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "shards",
        sa.Column("shard_id", sa.String(), nullable=False),
        sa.Column("model_id", sa.String(), nullable=False),
        sa.Column("weights_sha256", sa.String(), nullable=False),
        sa.Column("node_id", sa.String(), nullable=False),
        sa.Column("layer_lo", sa.Integer(), nullable=False),
        sa.Column("layer_hi", sa.Integer(), nullable=False, comment="inclusive"),
        sa.Column("total_layers", sa.Integer(), nullable=False),
        sa.Column("dtype", sa.String(), nullable=False),
        sa.Column("memory_required_mb", sa.Float(), nullable=False),
        sa.Column("max_concurrent_streams", sa.Integer(), nullable=False),
        sa.Column("control_subject", sa.String(), nullable=False),
        sa.Column("hop_weight", sa.Float(), nullable=False),
        sa.Column("ttl_s", sa.Float(), nullable=False),
        sa.Column("status", sa.String(), nullable=False, comment="advertised | withdrawn"),
        sa.Column("advertised_at", sa.Integer(), nullable=False, comment="epoch s"),
        sa.Column("expires_at", sa.Integer(), nullable=False, comment="epoch s, advertised_at + ttl_s"),
        sa.Column("withdrawn_at", sa.Integer(), nullable=True, comment="epoch s"),
        sa.Column("withdrawn_reason", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("shard_id", name=op.f("pk_shards")),
    )
    op.create_index(op.f("ix_shards_model_id_status"), "shards", ["model_id", "status"])

    op.create_table(
        "shard_health",
        sa.Column("shard_id", sa.String(), nullable=False),
        sa.Column("last_seen", sa.Integer(), nullable=False, comment="epoch s of the latest heartbeat"),
        sa.Column("queue_depth", sa.Integer(), nullable=False),
        sa.Column("active_streams", sa.Integer(), nullable=False),
        sa.Column("p95_latency_ms", sa.Float(), nullable=False, comment="duration"),
        sa.Column("tokens_served_total", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("shard_id", name=op.f("pk_shard_health")),
    )

    op.create_table(
        "pipelines",
        sa.Column("pipeline_id", sa.String(), nullable=False),
        sa.Column("request_id", sa.String(), nullable=True),
        sa.Column("model_id", sa.String(), nullable=True),
        sa.Column("weights_sha256", sa.String(), nullable=True),
        sa.Column("orchestrator_node_id", sa.String(), nullable=False),
        sa.Column(
            "status", sa.String(), nullable=False,
            comment="constructed | streaming | degraded | fallback_local | completed | aborted",
        ),
        sa.Column("hops", sa.Text(), nullable=False, comment="JSON list of shard_ids, current hops"),
        sa.Column("construct_ms", sa.Float(), nullable=True, comment="duration"),
        sa.Column("ttft_ms", sa.Float(), nullable=True, comment="duration"),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("duration_ms", sa.Float(), nullable=True, comment="duration"),
        sa.Column("tokens_per_second", sa.Float(), nullable=True),
        sa.Column("finish_reason", sa.String(), nullable=True),
        sa.Column("failovers", sa.Integer(), nullable=False),
        sa.Column("fell_back_to_local", sa.Integer(), nullable=False, comment="0/1"),
        sa.Column("fallback_reason", sa.Text(), nullable=True),
        sa.Column("last_shard_status", sa.String(), nullable=True, comment="degraded | healthy"),
        sa.Column("last_shard_status_shard_id", sa.String(), nullable=True),
        sa.Column("error_code", sa.String(), nullable=True),
        sa.Column("error_reason", sa.Text(), nullable=True),
        sa.Column("constructed_at", sa.Integer(), nullable=True, comment="epoch s"),
        sa.Column("first_token_at", sa.Integer(), nullable=True, comment="epoch s"),
        sa.Column("finished_at", sa.Integer(), nullable=True, comment="epoch s"),
        sa.Column("updated_at", sa.Integer(), nullable=False, comment="epoch s of the latest event"),
        sa.PrimaryKeyConstraint("pipeline_id", name=op.f("pk_pipelines")),
    )
    op.create_index(op.f("ix_pipelines_status"), "pipelines", ["status"])
    op.create_index(op.f("ix_pipelines_constructed_at"), "pipelines", ["constructed_at"])

    op.create_table(
        "failovers",
        sa.Column("pipeline_id", sa.String(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("failed_shard_id", sa.String(), nullable=False),
        sa.Column("replacement_hops", sa.Text(), nullable=False, comment="JSON list of shard_ids"),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("resumed_at_token", sa.Integer(), nullable=False),
        sa.Column("occurred_at", sa.Integer(), nullable=False, comment="epoch s"),
        sa.PrimaryKeyConstraint("pipeline_id", "n", name=op.f("pk_failovers")),
    )

    op.create_table(
        "shard_stats",
        sa.Column("shard_id", sa.String(), nullable=False),
        sa.Column(
            "tokens_served",
            sa.Integer(),
            nullable=False,
            comment="tokens_served_total of the latest heartbeat",
        ),
        sa.Column("pipelines_joined", sa.Integer(), nullable=False),
        sa.Column("failovers_caused", sa.Integer(), nullable=False),
        sa.Column("corruption_detections", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("shard_id", name=op.f("pk_shard_stats")),
    )

    op.create_table(
        "projection_positions",
        sa.Column("projection", sa.String(), nullable=False),
        sa.Column("stream", sa.String(), nullable=False),
        sa.Column("last_seq", sa.Integer(), nullable=False),
        sa.Column(
            "last_event_at", sa.Integer(), nullable=True, comment="epoch s the stream stored that message"
        ),
        sa.PrimaryKeyConstraint("projection", "stream", name=op.f("pk_projection_positions")),
    )


def downgrade() -> None:
    op.drop_table("projection_positions")
    op.drop_table("shard_stats")
    op.drop_table("failovers")
    op.drop_index(op.f("ix_pipelines_constructed_at"), table_name="pipelines")
    op.drop_index(op.f("ix_pipelines_status"), table_name="pipelines")
    op.drop_table("pipelines")
    op.drop_table("shard_health")
    op.drop_index(op.f("ix_shards_model_id_status"), table_name="shards")
    op.drop_table("shards")
