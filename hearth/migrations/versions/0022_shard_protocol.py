"""shards.protocol: the mesh protocol a shard advertises speaking (hearth/protocol/mesh_protocol.py), from
shard.advertised; NULL for a shard of a hearth from before protocol versions.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-06

A shard advertised before this revision keeps NULL until its next advertisement (well inside its TTL) sets it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.add_column(sa.Column("protocol", sa.Integer(), nullable=True,
                                   comment="mesh protocol it speaks (NULL: a hearth from before protocol versions)"))


def downgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.drop_column("protocol")
