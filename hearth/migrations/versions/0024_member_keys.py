"""member_keys: each member key a stream's log names (a verified `member.key_rotated` of a member other than the
steward, signed by a steward key), so a projection verifies what the member's new key signs there before its roster
file names it, and still does after a restart.

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-20

A database migrated from an earlier revision starts with no rows: a member's rotation its projector passed before is
judged from the roster, as then.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "member_keys",
        sa.Column("stream", sa.String(), nullable=False, comment="the stream whose log names it"),
        sa.Column("public_key", sa.String(), nullable=False, comment="the member's new key"),
        sa.Column("member", sa.String(), nullable=False, comment="the member's name (node id)"),
        sa.Column("succeeds", sa.String(), nullable=False, comment="the member's key it replaced there"),
        sa.Column("event_id", sa.String(), nullable=False, comment="the rotation that named it"),
        sa.Column("rotated_at", sa.Integer(), nullable=False, comment="epoch s the steward says"),
        sa.PrimaryKeyConstraint("stream", "public_key", name=op.f("pk_member_keys")),
    )


def downgrade() -> None:
    op.drop_table("member_keys")
