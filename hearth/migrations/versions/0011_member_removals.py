"""member_removals: each member's removal as a stream's log shows it (a steward's signed `member.removed`), so a
projection rejects what that member's key signed and the stream stored after it.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05

A database migrated from an earlier revision starts with no rows: a removal event its projector passed before (as
one it could not decode) is judged from the cut and time the roster records for it instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "member_removals",
        sa.Column("stream", sa.String(), nullable=False, comment="the stream whose position it marks"),
        sa.Column("public_key", sa.String(), nullable=False, comment="the removed member's key"),
        sa.Column("member", sa.String(), nullable=False, comment="its name (node id)"),
        sa.Column("event_id", sa.String(), nullable=False, comment="the first removal event of it there"),
        sa.Column("removed_at", sa.Integer(), nullable=False, comment="epoch s the steward says"),
        sa.PrimaryKeyConstraint("stream", "public_key", name=op.f("pk_member_removals")),
    )


def downgrade() -> None:
    op.drop_table("member_removals")
