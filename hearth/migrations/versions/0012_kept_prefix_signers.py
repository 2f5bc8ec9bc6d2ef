"""kept_prefixes.signer: a kept-prefix record is its signer's, keyed by (signer, name), so a member that copies
another's mark from the log into a completion of its own neither replaces nor shadows that member's record.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06

Records kept before this revision do not say who signed them: they are carried over as unsigned (''), which is what a
rebuild makes of them on an open mesh; on a community mesh no member's routing reads them, and the retention prunes them
once they expired before the log's pipelines cutoff, while routing learns again from the next calls that keep blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TABLE = "kept_prefixes"
_OLD_TABLE = "kept_prefixes_before_0012"
_INDEX = "ix_kept_prefixes_expires_at"
_RECORD_COLUMNS = "name, pipeline_id, hops, blocks, kept_at, expires_at"


def _record_columns() -> list[sa.Column]:
    return [
        sa.Column("name", sa.String(), nullable=False, comment="128-bit block name, hex"),
        sa.Column("pipeline_id", sa.String(), nullable=False),
        sa.Column("hops", sa.Text(), nullable=False,
                  comment="JSON list of [shard_id, layer_lo, layer_hi] (inclusive), in chain order"),
        sa.Column("blocks", sa.Integer(), nullable=False, comment="blocks kept up to and with this one"),
        sa.Column("kept_at", sa.Integer(), nullable=False, comment="epoch s"),
        sa.Column("expires_at", sa.Integer(), nullable=False,
                  comment="epoch s, kept_at + the hops' idle time for kept blocks"),
    ]


def _set_aside() -> None:
    """Move the table out of the way (its index first: SQLite keeps an index's name when its table is renamed)."""
    op.drop_index(_INDEX, table_name=_TABLE)
    op.rename_table(_TABLE, _OLD_TABLE)


def upgrade() -> None:
    _set_aside()
    op.create_table(
        _TABLE,
        sa.Column("signer", sa.String(), nullable=False,
                  comment="public key that signed the event ('': unsigned, an open mesh)"),
        *_record_columns(),
        sa.PrimaryKeyConstraint("signer", "name", name=op.f("pk_kept_prefixes")),
    )
    op.execute(f"INSERT INTO {_TABLE} (signer, {_RECORD_COLUMNS}) SELECT '', {_RECORD_COLUMNS} FROM {_OLD_TABLE}")
    op.drop_table(_OLD_TABLE)
    op.create_index(op.f(_INDEX), _TABLE, ["expires_at"])


def downgrade() -> None:
    _set_aside()
    op.create_table(_TABLE, *_record_columns(), sa.PrimaryKeyConstraint("name", name=op.f("pk_kept_prefixes")))
    # One row per name, as the table was: the latest kept of each.
    op.execute(f"INSERT OR REPLACE INTO {_TABLE} ({_RECORD_COLUMNS}) SELECT {_RECORD_COLUMNS} FROM {_OLD_TABLE} "
               "ORDER BY kept_at, signer")
    op.drop_table(_OLD_TABLE)
    op.create_index(op.f(_INDEX), _TABLE, ["expires_at"])
