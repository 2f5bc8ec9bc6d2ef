"""The rejected_events table: events a projection did not apply because they failed the signature check.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "rejected_events",
        sa.Column("stream", sa.String(), nullable=False),
        sa.Column("stream_seq", sa.Integer(), nullable=False),
        sa.Column("event_id", sa.String(), nullable=False),
        sa.Column("type", sa.String(), nullable=False),
        sa.Column("node_id", sa.String(), nullable=False, comment="the node the event claims"),
        sa.Column("signer", sa.String(), nullable=True, comment="the public key it names (NULL: unsigned)"),
        sa.Column(
            "reason", sa.String(), nullable=False,
            comment="unsigned | unknown_signer | bad_signature | role_may_not_emit | node_mismatch | future_dated",
        ),
        sa.Column("occurred_at", sa.Integer(), nullable=False, comment="epoch s the event claims"),
        sa.Column(
            "rejected_at", sa.Integer(), nullable=False,
            comment="epoch s the stream stored it (from the log, not the clock, so a rebuild gives the same row)",
        ),
        sa.PrimaryKeyConstraint("stream", "stream_seq", name=op.f("pk_rejected_events")),
    )
    op.create_index(op.f("ix_rejected_events_reason"), "rejected_events", ["reason"])


def downgrade() -> None:
    op.drop_index(op.f("ix_rejected_events_reason"), table_name="rejected_events")
    op.drop_table("rejected_events")
