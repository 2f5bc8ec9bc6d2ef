"""shard_reputation and integrity_evidence: what spot-checks confirmed about each shard, the mismatches blamed on
it (with their evidence) and whether it is quarantined.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29

A database migrated from an earlier revision holds every shard as unchecked and none quarantined until the
projector applies the integrity events from its position on; `hearth-replay rebuild` fills both from the whole log.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "shard_reputation",
        sa.Column("shard_id", sa.String(), nullable=False),
        sa.Column("node_id", sa.String(), nullable=True, comment="the host, from the shard id (NULL: not parsed)"),
        sa.Column("checks", sa.Integer(), nullable=False, comment="checks that found nothing wrong"),
        sa.Column("verified_positions", sa.Integer(), nullable=False, comment="positions they confirmed"),
        sa.Column("mismatches", sa.Integer(), nullable=False, comment="confirmed against it"),
        sa.Column("disputes", sa.Integer(), nullable=False, comment="disagreements nobody could settle"),
        sa.Column("status", sa.String(), nullable=False, comment="ok | quarantined"),
        sa.Column("status_since", sa.Integer(), nullable=True,
                  comment="epoch s of the event that set the status (NULL: never quarantined)"),
        sa.Column("status_event_id", sa.String(), nullable=True,
                  comment="the confirming mismatch (quarantined) or the clearing (ok again)"),
        sa.Column("status_reason", sa.Text(), nullable=True,
                  comment="the evidence summary (quarantined) or the steward's reason (cleared)"),
        sa.Column("updated_at", sa.Integer(), nullable=False, comment="epoch s of the latest event"),
        sa.PrimaryKeyConstraint("shard_id", name=op.f("pk_shard_reputation")),
    )
    op.create_index(op.f("ix_shard_reputation_status"), "shard_reputation", ["status"])
    op.create_table(
        "integrity_evidence",
        sa.Column("shard_id", sa.String(), nullable=False),
        sa.Column("event_id", sa.String(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False, comment="confirmed | disputed"),
        sa.Column("pipeline_id", sa.String(), nullable=False),
        sa.Column("reported_by", sa.String(), nullable=False, comment="the orchestrator's node id"),
        sa.Column("witnesses", sa.Text(), nullable=False,
                  comment="JSON list of shard_ids: who agreed against it (confirmed) or the one it disagreed "
                          "with (disputed)"),
        sa.Column("layer_lo", sa.Integer(), nullable=False),
        sa.Column("layer_hi", sa.Integer(), nullable=False, comment="inclusive"),
        sa.Column("quantization", sa.String(), nullable=False),
        sa.Column("dtype", sa.String(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("step_kind", sa.String(), nullable=False, comment="prefill | decode"),
        sa.Column("relative_error", sa.Float(), nullable=False),
        sa.Column("tolerance", sa.Float(), nullable=False),
        sa.Column("evidence_sha256", sa.String(), nullable=False),
        sa.Column("occurred_at", sa.Integer(), nullable=False, comment="epoch s"),
        sa.PrimaryKeyConstraint("shard_id", "event_id", name=op.f("pk_integrity_evidence")),
    )


def downgrade() -> None:
    op.drop_table("integrity_evidence")
    op.drop_index(op.f("ix_shard_reputation_status"), table_name="shard_reputation")
    op.drop_table("shard_reputation")
