"""applied_events: the id of each event a projection applied, per stream, so a copy stored again past the broker's
duplicate window is rejected `duplicate` instead of being counted twice (hearth/readmodels/applied_events.py).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06

A database migrated from an earlier revision starts with no ids; a migration cannot read the stream, so its projector's
next start records the ids of the retained events it applied before (hearth/readmodels/applied_backfill.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None



def upgrade() -> None:
    # Keyed by time first and without a rowid: one B-tree, appended to at its end, pruned from its start.
    op.create_table(
        "applied_events",
        sa.Column("stream", sa.String(), nullable=False),
        sa.Column("occurred_at", sa.Integer(), nullable=False, comment="epoch s the event claims"),
        sa.Column("event_id", sa.String(), nullable=False),
        sa.PrimaryKeyConstraint("stream", "occurred_at", "event_id", name=op.f("pk_applied_events")),
        sqlite_with_rowid=False,
    )


def downgrade() -> None:
    op.drop_table("applied_events")
