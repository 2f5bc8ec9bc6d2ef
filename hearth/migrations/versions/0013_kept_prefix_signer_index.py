"""kept_prefixes by (signer, expires_at, kept_at): a kept-prefix record is pruned against its own signer's latest,
so the records a batch prunes are one range of that signer's and their latest kept_at is read off the index alone.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_INDEX = "ix_kept_prefixes_signer_expires_at_kept_at"


def upgrade() -> None:
    op.create_index(op.f(_INDEX), "kept_prefixes", ["signer", "expires_at", "kept_at"])


def downgrade() -> None:
    op.drop_index(op.f(_INDEX), table_name="kept_prefixes")
