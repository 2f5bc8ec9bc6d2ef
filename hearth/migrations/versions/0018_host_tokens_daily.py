"""host_tokens_daily replaces shard_tokens_daily: tokens through each host per day, a call counted once on a host
however many of its hops that host held (shard_tokens_daily counted it once per shard, so the dashboard's sum over
a host's shards counted such a call twice).

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06

The days held are carried over: each host's shards summed, less what the calls the pipelines table still holds
counted more than once on it (a call's tokens for each of its hops on that host past the first). A day whose calls
the retention already pruned keeps what it counted then; `hearth-replay rebuild` counts the days the log holds anew.
A downgrade gives shard_tokens_daily one row per host and day, named by the node (a shard id naming no node: itself).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SECONDS_PER_DAY = 86400


def _node_of(column: str) -> str:
    """hearth/protocol/subjects.py's node_of_shard in SQL (what follows the last `@`), or the id when it names none."""
    after_last_at = f"substr({column}, length(rtrim({column}, replace({column}, '@', ''))) + 1)"
    return f"CASE WHEN instr({column}, '@') > 0 AND {after_last_at} <> '' THEN {after_last_at} ELSE {column} END"


# Per (day, host): the shards' rows summed, less each held completed call's tokens times (its distinct hops on that
# host - 1), the day by finished_at as the projection counted it; only (day, host) pairs that had rows.
_CARRY_OVER = f"""INSERT INTO host_tokens_daily (day, node_id, tokens)
SELECT day, node_id, MAX(0, SUM(tokens)) FROM (
  SELECT day, {_node_of('shard_id')} AS node_id, tokens, 1 AS counted FROM shard_tokens_daily
  UNION ALL
  SELECT day, node_id, -tokens * (COUNT(*) - 1), 0 FROM (
    SELECT DISTINCT pipelines.pipeline_id AS pipeline_id,
           pipelines.finished_at / {SECONDS_PER_DAY} * {SECONDS_PER_DAY} AS day,
           COALESCE(pipelines.prompt_tokens, 0) + COALESCE(pipelines.completion_tokens, 0) AS tokens,
           hop.value AS shard_id, {_node_of('hop.value')} AS node_id
    FROM pipelines, json_each(pipelines.hops) AS hop
    WHERE pipelines.status = 'completed' AND pipelines.finished_at IS NOT NULL AND json_valid(pipelines.hops)
  ) GROUP BY pipeline_id, node_id HAVING COUNT(*) > 1
) GROUP BY day, node_id HAVING SUM(counted) > 0"""


def upgrade() -> None:
    op.create_table(
        "host_tokens_daily",
        sa.Column("day", sa.Integer(), nullable=False, comment="epoch s of 00:00 UTC that day"),
        sa.Column("node_id", sa.String(), nullable=False,
                  comment="the node its hops' shard ids name (a shard id naming none: itself)"),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("day", "node_id", name=op.f("pk_host_tokens_daily")),
    )
    op.execute(_CARRY_OVER)
    op.drop_table("shard_tokens_daily")


def downgrade() -> None:
    op.create_table(
        "shard_tokens_daily",
        sa.Column("day", sa.Integer(), nullable=False, comment="epoch s of 00:00 UTC that day"),
        sa.Column("shard_id", sa.String(), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("day", "shard_id", name=op.f("pk_shard_tokens_daily")),
    )
    op.execute("INSERT INTO shard_tokens_daily (day, shard_id, tokens) SELECT day, node_id, tokens "
               "FROM host_tokens_daily")
    op.drop_table("host_tokens_daily")
