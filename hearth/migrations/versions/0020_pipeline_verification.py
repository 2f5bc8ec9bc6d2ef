"""pipelines.verification: whether a completed call's hops were checked as its `verify` level asked (`met`, `unmet`;
NULL at `none`), from pipeline.completed, with an index for the panel counting the unmet calls.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-06

A call completed before this revision gets `unrecorded` (its outcome is unknown): `hearth-replay rebuild --diff` does
not compare the column there (hearth/readmodels/log_window.py), and the dashboards count only `met` and `unmet`. A
call not yet ended keeps NULL until its pipeline.completed sets it.
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
                                   comment="met | unmet: its hops checked as its verify level asks (NULL: none or "
                                           "not ended; unrecorded: completed before migration 0020)"))
    op.execute("UPDATE pipelines SET verification = 'unrecorded' WHERE status = 'completed'")
    op.create_index(op.f("ix_pipelines_verification_constructed_at_model_id"), "pipelines",
                    ["verification", "constructed_at", "model_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_pipelines_verification_constructed_at_model_id"), table_name="pipelines")
    with op.batch_alter_table("pipelines") as batch:
        batch.drop_column("verification")
