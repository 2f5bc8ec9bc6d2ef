"""shard_reputation.quarantined_by: the node whose confirmed mismatch quarantined each shard, so a reporter's
accusations hold at most MAX_NODES_HELD_PER_REPORTER nodes at once (hearth/readmodels/reputation.py).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-09

A quarantine held before this revision gets the reporter of the evidence that set it (integrity_evidence.reported_by
of its status_event_id), so it counts against that reporter's bound as it would have; the bound holds for accusations
applied from now on, and quarantines held already stay held.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_INDEX = "ix_shard_reputation_quarantined_by"


def upgrade() -> None:
    with op.batch_alter_table("shard_reputation") as batch:
        batch.add_column(sa.Column(
            "quarantined_by", sa.String(), nullable=True,
            comment="the node whose confirmed mismatch quarantined it (NULL: not quarantined)"))
    op.create_index(_INDEX, "shard_reputation", ["quarantined_by"])
    op.execute("UPDATE shard_reputation SET quarantined_by = (SELECT e.reported_by FROM integrity_evidence e "
               "WHERE e.shard_id = shard_reputation.shard_id AND e.event_id = shard_reputation.status_event_id) "
               "WHERE status = 'quarantined'")


def downgrade() -> None:
    op.drop_index(_INDEX, table_name="shard_reputation")
    with op.batch_alter_table("shard_reputation") as batch:
        batch.drop_column("quarantined_by")
