"""Retention: rejected_event_counts (every rejected event counted per minute, stream and reason, where rejected_events
keeps samples), and the indexes the pruning of history by age reads (failovers.occurred_at,
rejected_events (stream, rejected_at); hearth/readmodels/retention.py), and shard_stats.last_counted_at, so a shard's
counters are pruned only once no call counted on it within the retention.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05

The counts are filled from the rejected_events rows already held; those rows stay until they age out. Counters held
before this revision have no last_counted_at: they go with their shard's rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "rejected_event_counts",
        sa.Column("minute", sa.Integer(), nullable=False, comment="epoch s, a multiple of 60"),
        sa.Column("stream", sa.String(), nullable=False),
        sa.Column("reason", sa.String(), nullable=False),
        sa.Column("events", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("minute", "stream", "reason", name=op.f("pk_rejected_event_counts")),
    )
    op.execute("INSERT INTO rejected_event_counts (minute, stream, reason, events) "
               "SELECT rejected_at / 60 * 60, stream, reason, COUNT(*) FROM rejected_events GROUP BY 1, 2, 3")
    op.create_index(op.f("ix_rejected_events_stream_rejected_at"), "rejected_events", ["stream", "rejected_at"])
    op.create_index(op.f("ix_failovers_occurred_at"), "failovers", ["occurred_at"])
    with op.batch_alter_table("shard_stats") as batch:
        batch.add_column(sa.Column("last_counted_at", sa.Integer(), nullable=True,
                                   comment="epoch s of the latest pipelines-stream event counted on it (NULL: none "
                                           "yet)"))


def downgrade() -> None:
    with op.batch_alter_table("shard_stats") as batch:
        batch.drop_column("last_counted_at")
    op.drop_index(op.f("ix_failovers_occurred_at"), table_name="failovers")
    op.drop_index(op.f("ix_rejected_events_stream_rejected_at"), table_name="rejected_events")
    op.drop_table("rejected_event_counts")
