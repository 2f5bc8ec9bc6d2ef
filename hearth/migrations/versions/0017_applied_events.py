"""applied_events: the id of each event a projection applied, per stream, so a copy stored again past the broker's
duplicate window is rejected `duplicate` instead of being counted twice (hearth/readmodels/applied_events.py).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06

A database migrated from an earlier revision starts with no ids: an event it applied before is not known to it, so a
copy of one stored after the upgrade is applied once more (the gap this revision closes from now on).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_INDEX = "ix_applied_events_stream_occurred_at"


def upgrade() -> None:
    op.create_table(
        "applied_events",
        sa.Column("stream", sa.String(), nullable=False),
        sa.Column("event_id", sa.String(), nullable=False),
        sa.Column("occurred_at", sa.Integer(), nullable=False, comment="epoch s the event claims"),
        sa.PrimaryKeyConstraint("stream", "event_id", name=op.f("pk_applied_events")),
    )
    op.create_index(_INDEX, "applied_events", ["stream", "occurred_at"])


def downgrade() -> None:
    op.drop_index(_INDEX, table_name="applied_events")
    op.drop_table("applied_events")
