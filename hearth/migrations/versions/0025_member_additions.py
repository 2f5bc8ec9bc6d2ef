"""member_additions: each member a stream's log adds (a verified `member.added`, signed by a steward key), so a
projection verifies what the new member signs there before its roster file names it, and still does after a
restart.

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-21

A database migrated from an earlier revision starts with no rows: a member added before is judged from the roster,
as then.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0025"
down_revision: str | None = "0024"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "member_additions",
        sa.Column("stream", sa.String(), nullable=False, comment="the stream whose log adds it"),
        sa.Column("public_key", sa.String(), nullable=False, comment="the member's key"),
        sa.Column("member", sa.String(), nullable=False, comment="the member's name (node id)"),
        sa.Column("role", sa.String(), nullable=False, comment="its role, as the roster would give it"),
        sa.Column("trust", sa.String(), nullable=False, comment="its trust level, as the roster would give it"),
        sa.Column("event_id", sa.String(), nullable=False, comment="the addition that added it"),
        sa.Column("added_at", sa.Integer(), nullable=False, comment="epoch s the steward says"),
        sa.PrimaryKeyConstraint("stream", "public_key", name=op.f("pk_member_additions")),
    )


def downgrade() -> None:
    op.drop_table("member_additions")
