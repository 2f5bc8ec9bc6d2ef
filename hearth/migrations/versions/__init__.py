"""Alembic revisions of the read-model schema (a package only so installed wheels include them)."""
