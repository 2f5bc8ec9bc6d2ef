"""pipelines.verification: whether a completed call's hops were checked as its `verify` level asked (`met`, `unmet`;
NULL at `none`), from pipeline.completed, with an index for the panel counting the unmet calls.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-06

Pipelines projected before this revision keep NULL; `hearth-replay rebuild` fills it from the log (a call completed
before the outcome was recorded reads NULL there too).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("pipelines") as batch:
        batch.add_column(sa.Column("verification", sa.String(), nullable=True,
                                   comment="met | unmet: its hops checked as its verify level asks (NULL: none)"))
    op.create_index(op.f("ix_pipelines_verification_constructed_at_model_id"), "pipelines",
                    ["verification", "constructed_at", "model_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_pipelines_verification_constructed_at_model_id"), table_name="pipelines")
    with op.batch_alter_table("pipelines") as batch:
        batch.drop_column("verification")
