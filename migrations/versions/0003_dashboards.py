"""What the Grafana dashboards read: event_counts (events per type per minute), shard_tokens_daily (tokens through
each shard per day), and one index covering every time-range query over pipelines.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23

A database migrated from 0002 counts only the events applied from then on; `hearth-replay rebuild` counts the
whole log.
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
    op.drop_index(op.f("ix_pipelines_constructed_at"), table_name="pipelines")
    op.create_index(op.f(PIPELINE_RANGE_INDEX), "pipelines", PIPELINE_RANGE_COLUMNS)


def downgrade() -> None:
    op.drop_index(op.f(PIPELINE_RANGE_INDEX), table_name="pipelines")
    op.create_index(op.f("ix_pipelines_constructed_at"), "pipelines", ["constructed_at"])
    op.drop_table("shard_tokens_daily")
    op.drop_table("event_counts")
