"""What the Grafana dashboards read: event_counts (events per type per minute), shard_tokens_daily (tokens through
each shard per day), pipeline_minutes (per-minute percentiles), and one index covering every time-range query
over pipelines.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23

A database migrated from 0002 fills these tables only from the events applied from then on; `hearth-replay
rebuild` fills them from the whole log.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PIPELINE_RANGE_COLUMNS = ["constructed_at", "status", "error_code", "fell_back_to_local", "ttft_ms",
                          "tokens_per_second"]
PIPELINE_RANGE_INDEX = "ix_pipelines_" + "_".join(PIPELINE_RANGE_COLUMNS)


def upgrade() -> None:
    op.create_table(
        "event_counts",
        sa.Column("minute", sa.Integer(), nullable=False, comment="epoch s, a multiple of 60"),
        sa.Column("type", sa.String(), nullable=False),
        sa.Column("events", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("minute", "type", name=op.f("pk_event_counts")),
    )
    op.create_table(
        "shard_tokens_daily",
        sa.Column("day", sa.Integer(), nullable=False, comment="epoch s of 00:00 UTC that day"),
        sa.Column("shard_id", sa.String(), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("day", "shard_id", name=op.f("pk_shard_tokens_daily")),
    )
    op.create_table(
        "pipeline_minutes",
        sa.Column("minute", sa.Integer(), nullable=False, comment="epoch s, a multiple of 60"),
        sa.Column("calls", sa.Integer(), nullable=False),
        sa.Column("ttft_p50_ms", sa.Float(), nullable=True, comment="duration"),
        sa.Column("ttft_p95_ms", sa.Float(), nullable=True, comment="duration"),
        sa.Column("tokens_per_second_p50", sa.Float(), nullable=True, comment="completed calls"),
        sa.Column("tokens_per_second_p95", sa.Float(), nullable=True, comment="completed calls"),
        sa.PrimaryKeyConstraint("minute", name=op.f("pk_pipeline_minutes")),
    )
    op.drop_index(op.f("ix_pipelines_constructed_at"), table_name="pipelines")
    op.create_index(op.f(PIPELINE_RANGE_INDEX), "pipelines", PIPELINE_RANGE_COLUMNS)


def downgrade() -> None:
    op.drop_index(op.f(PIPELINE_RANGE_INDEX), table_name="pipelines")
    op.create_index(op.f("ix_pipelines_constructed_at"), "pipelines", ["constructed_at"])
    op.drop_table("pipeline_minutes")
    op.drop_table("shard_tokens_daily")
    op.drop_table("event_counts")
