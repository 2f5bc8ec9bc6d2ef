"""shard_health.decode_step_ms: each shard's measured decode step time (its heartbeat), for routing by latency.

Revision ID: 0004
Revises: 0003 (0002 on a branch that does not have 0003 yet)
Create Date: 2026-11-23

A database migrated from an earlier revision has NULL (not measured) until each shard's next heartbeat.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("shard_health") as batch:
        batch.add_column(sa.Column("decode_step_ms", sa.Float(), nullable=True,
                                   comment="duration: median decode step over the shard's range "
                                           "(NULL: not measured yet)"))


def downgrade() -> None:
    with op.batch_alter_table("shard_health") as batch:
        batch.drop_column("decode_step_ms")
