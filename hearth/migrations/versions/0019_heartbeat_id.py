"""shard_health.heartbeat_id: the id of the heartbeat each row states, so a copy of it stored again is known and
counts nothing in event_counts (hearth/readmodels/applied_events.py: heartbeats keep no applied_events id).

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06

A row written before this revision has none: a copy of the heartbeat it states, stored after the upgrade, counts once
more, once; the shard's next heartbeat sets it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("shard_health") as batch:
        batch.add_column(sa.Column("heartbeat_id", sa.String(), nullable=True,
                                   comment="event id of the heartbeat the row states (NULL: written before 0019)"))


def downgrade() -> None:
    with op.batch_alter_table("shard_health") as batch:
        batch.drop_column("heartbeat_id")
