"""The event_counts table: events applied per type per minute, for the Event log dashboard.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23

A database migrated from 0002 counts only the events applied from now on; `hearth-replay rebuild` counts the
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


def upgrade() -> None:
    op.create_table(
        "event_counts",
        sa.Column("minute", sa.Integer(), nullable=False, comment="epoch s, a multiple of 60"),
        sa.Column("type", sa.String(), nullable=False),
        sa.Column("events", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("minute", "type", name=op.f("pk_event_counts")),
    )


def downgrade() -> None:
    op.drop_table("event_counts")
