"""kept_prefixes: which chain's hops keep which call's blocks, by block name (routing's prefix affinity across
orchestrators).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01

A database migrated from an earlier revision starts with no records: routing learns them from the next calls
that keep blocks (older records would have expired anyway).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "kept_prefixes",
        sa.Column("name", sa.String(), nullable=False, comment="128-bit block name, hex"),
        sa.Column("pipeline_id", sa.String(), nullable=False),
        sa.Column("hops", sa.Text(), nullable=False,
                  comment="JSON list of [shard_id, layer_lo, layer_hi] (inclusive), in chain order"),
        sa.Column("blocks", sa.Integer(), nullable=False, comment="blocks kept up to and with this one"),
        sa.Column("kept_at", sa.Integer(), nullable=False, comment="epoch s"),
        sa.Column("expires_at", sa.Integer(), nullable=False,
                  comment="epoch s, kept_at + the hops' idle time for kept blocks"),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_kept_prefixes")),
    )
    op.create_index(op.f("ix_kept_prefixes_expires_at"), "kept_prefixes", ["expires_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_kept_prefixes_expires_at"), table_name="kept_prefixes")
    op.drop_table("kept_prefixes")
