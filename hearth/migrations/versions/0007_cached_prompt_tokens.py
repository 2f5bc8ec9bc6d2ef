"""pipelines.cached_prompt_tokens: the prompt positions a pipeline's hops held from earlier calls (kept prefixes).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28

Pipelines projected before this revision keep NULL; `hearth-replay rebuild` fills it from the whole log (events
recorded before kept prefixes existed read as 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("pipelines") as batch:
        batch.add_column(sa.Column("cached_prompt_tokens", sa.Integer(), nullable=True,
                                   comment="prompt positions its hops held from earlier calls (kept prefixes), "
                                           "not prefilled"))


def downgrade() -> None:
    with op.batch_alter_table("pipelines") as batch:
        batch.drop_column("cached_prompt_tokens")
