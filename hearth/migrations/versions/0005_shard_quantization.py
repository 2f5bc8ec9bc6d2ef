"""shards.quantization: the weight quantization scheme each shard advertises, for routing by scheme.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27

A database migrated from an earlier revision reads "none" (full precision) for every shard, as advertisements
from before quantization do.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.add_column(sa.Column("quantization", sa.String(), nullable=False, server_default="none",
                                   comment="weight quantization scheme: none | int8 | int4/gN"))


def downgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.drop_column("quantization")
