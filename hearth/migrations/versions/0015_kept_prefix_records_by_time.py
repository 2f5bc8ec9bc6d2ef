"""kept_prefixes keyed by (signer, name, kept_at): every record of a name is its own row, so a record dated before one
already held never replaces it, a signer's latest kept_at never goes down, and what its pruning leaves does not depend
on where batches were cut (hearth/readmodels/kept_prefixes.py).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-08

Rows carry over as they are (one per (signer, name) fits the wider key). Down again, each (signer, name) keeps only its
latest kept record, the one lookups preferred while it had not expired.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TABLE = "kept_prefixes"
_OLD_TABLE = "kept_prefixes_before_0015"
_RETENTION_INDEX = {"ix_kept_prefixes_expires_at": ["expires_at"]}
_OLD_INDEXES = {**_RETENTION_INDEX, "ix_kept_prefixes_signer_expires_at_kept_at": ["signer", "expires_at", "kept_at"]}
# A signer's latest kept_at, its pruning bound, is one step of its own index (it was a walk of all the signer's rows,
# which now include the records a later one superseded until they expire).
_NEW_INDEXES = {**_RETENTION_INDEX, "ix_kept_prefixes_signer_expires_at": ["signer", "expires_at"],
                "ix_kept_prefixes_signer_kept_at": ["signer", "kept_at"]}
_COLUMNS = "signer, name, pipeline_id, hops, blocks, kept_at, expires_at"


def _columns() -> list[sa.Column]:
    return [
        sa.Column("signer", sa.String(), nullable=False,
                  comment="public key that signed the event ('': unsigned, an open mesh)"),
        sa.Column("name", sa.String(), nullable=False, comment="128-bit block name, hex"),
        sa.Column("pipeline_id", sa.String(), nullable=False),
        sa.Column("hops", sa.Text(), nullable=False,
                  comment="JSON list of [shard_id, layer_lo, layer_hi] (inclusive), in chain order"),
        sa.Column("blocks", sa.Integer(), nullable=False, comment="blocks kept up to and with this one"),
        sa.Column("kept_at", sa.Integer(), nullable=False, comment="epoch s"),
        sa.Column("expires_at", sa.Integer(), nullable=False,
                  comment="epoch s, kept_at + the hops' idle time for kept blocks"),
    ]


def _rebuild(key: list[str], indexes: dict[str, list[str]], dropped: dict[str, list[str]], copy_rows: str) -> None:
    """Make the table anew with primary key `key` and `indexes`, filled by `copy_rows` from the old one (its
    `dropped` indexes first: SQLite keeps an index's name when its table is renamed)."""
    for index in dropped:
        op.drop_index(op.f(index), table_name=_TABLE)
    op.rename_table(_TABLE, _OLD_TABLE)
    op.create_table(_TABLE, *_columns(), sa.PrimaryKeyConstraint(*key, name=op.f("pk_kept_prefixes")))
    op.execute(copy_rows)
    op.drop_table(_OLD_TABLE)
    for index, columns in indexes.items():
        op.create_index(op.f(index), _TABLE, columns)


def upgrade() -> None:
    _rebuild(["signer", "name", "kept_at"], _NEW_INDEXES, _OLD_INDEXES,
             f"INSERT INTO {_TABLE} ({_COLUMNS}) SELECT {_COLUMNS} FROM {_OLD_TABLE}")


def downgrade() -> None:
    # The key holds no two rows of one (signer, name, kept_at): the latest kept of each (signer, name) is one row.
    _rebuild(["signer", "name"], _OLD_INDEXES, _NEW_INDEXES,
             f"INSERT OR REPLACE INTO {_TABLE} ({_COLUMNS}) SELECT {_COLUMNS} FROM {_OLD_TABLE} ORDER BY kept_at")
