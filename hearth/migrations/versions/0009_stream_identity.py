"""projection_positions.stream_created: the creation time of the stream a position was taken in, so a stream deleted
and created again (its sequences start over) is told apart and read again from its start.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05

Positions stored before this revision keep NULL until a projector next looks at their stream, which it then takes
for the one they were taken in.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("projection_positions") as batch:
        batch.add_column(sa.Column("stream_created", sa.String(), nullable=True,
                                   comment="ISO 8601 UTC creation time of the stream, as the broker reports it"))


def downgrade() -> None:
    with op.batch_alter_table("projection_positions") as batch:
        batch.drop_column("stream_created")
