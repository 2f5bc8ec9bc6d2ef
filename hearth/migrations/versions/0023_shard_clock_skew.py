"""shard_health.clock_skew_s: how far its latest heartbeat's date is off when the broker stored it (a rejected
future_dated one included), so routing can say a shard is left out because its host's clock is off.

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-06

A row written before this revision keeps NULL until its shard's next heartbeat (seconds) sets it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("shard_health") as batch:
        batch.add_column(sa.Column(
            "clock_skew_s", sa.Integer(), nullable=True,
            comment="duration: its latest heartbeat's date less when the broker stored it, one rejected "
                    "future_dated included (NULL: written before 0023)"))


def downgrade() -> None:
    with op.batch_alter_table("shard_health") as batch:
        batch.drop_column("clock_skew_s")
