"""shard_stats.first_counted_at and shard_reputation.first_event_at: when each row's sums began, so `hearth-replay
rebuild --diff` compares the counters a log that dropped its oldest messages still holds whole, and leaves out only
those that began before it (hearth/readmodels/log_window.py).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07

Rows held before this revision do not say when their sums began: they get 0, before any window, so a diff keeps
leaving them out as it did (and, against a log that dropped nothing, compares their counters but not that 0);
counters that hold nothing from the pipelines stream (a shard only heartbeats made) keep NULL, none counted yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("shard_stats") as batch:
        batch.add_column(sa.Column(
            "first_counted_at", sa.Integer(), nullable=True,
            comment="epoch s of the earliest pipelines-stream event counted on it (NULL: none yet; 0: counted before "
                    "this was recorded)"))
    op.execute("UPDATE shard_stats SET first_counted_at = 0 WHERE last_counted_at IS NOT NULL "
               "OR pipelines_joined + failovers_caused + corruption_detections > 0")
    with op.batch_alter_table("shard_reputation") as batch:
        batch.add_column(sa.Column(
            "first_event_at", sa.Integer(), nullable=False, server_default="0",
            comment="epoch s of the earliest event summed into it (0: summed before this was recorded)"))


def downgrade() -> None:
    with op.batch_alter_table("shard_reputation") as batch:
        batch.drop_column("first_event_at")
    with op.batch_alter_table("shard_stats") as batch:
        batch.drop_column("first_counted_at")
