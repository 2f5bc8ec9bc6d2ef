"""steward_keys: each steward key a stream's log names (a verified `member.key_rotated` of the `system` member,
signed by the key it retires), so a projection verifies what the new steward key signs there before its roster file
names it, and still does after a restart.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-07

A database migrated from an earlier revision starts with no rows: a rotation its projector passed before is judged
from the roster, as then.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "steward_keys",
        sa.Column("stream", sa.String(), nullable=False, comment="the stream whose log names it"),
        sa.Column("public_key", sa.String(), nullable=False, comment="the new steward key"),
        sa.Column("succeeds", sa.String(), nullable=False, comment="the steward key it replaced there"),
        sa.Column("event_id", sa.String(), nullable=False, comment="the rotation that named it"),
        sa.Column("rotated_at", sa.Integer(), nullable=False, comment="epoch s the steward says"),
        sa.PrimaryKeyConstraint("stream", "public_key", name=op.f("pk_steward_keys")),
    )


def downgrade() -> None:
    op.drop_table("steward_keys")
