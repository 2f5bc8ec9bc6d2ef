"""`hearth db`: creates or migrates a read-model SQLite file (`upgrade`), rewrites it without its free pages
(`vacuum`) and copies it while it is written (`backup`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NoReturn

import typer

from hearth.services.cli_options import EXIT_BAD_INPUT, EXIT_REFUSED

db_app = typer.Typer(help="Manage a read-model SQLite database. One that is damaged (refused in one line) is made "
                     "again from the event log: hearth-replay rebuild --db PATH --force.", no_args_is_help=True,
                     rich_markup_mode=None)


@db_app.command("upgrade")
def db_upgrade_command(
    db: Annotated[Path, typer.Option("--db", help="SQLite read-model file (created when missing).")],
) -> None:
    """Create or migrate a read-model database to the latest schema (Alembic)."""
    from hearth.readmodels.db import ReadModelUnusable, upgrade_database

    try:
        upgrade_database(db)
    except ReadModelUnusable as error:
        _refuse("upgrade", str(error), EXIT_REFUSED)
    typer.echo(f"{db}: schema at the latest revision")


@db_app.command("vacuum")
def db_vacuum_command(
    db: Annotated[Path, typer.Option("--db", help="SQLite read-model file to rewrite.")],
) -> None:
    """Rewrite a read-model database without its free pages (a full VACUUM; projectors give pages back as they prune,
    so this is rarely needed). It holds the write lock throughout: a running projector's batches wait for it."""
    from sqlalchemy.exc import OperationalError

    from hearth.readmodels.db import ReadModelUnusable, open_engine, vacuum_database

    if not db.is_file():
        _refuse("vacuum", f"{db}: no such read-model file", EXIT_BAD_INPUT)
    before = _bytes_on_disk(db)
    engine = open_engine(db)
    try:
        vacuum_database(engine)
    except OperationalError as error:
        _refuse("vacuum", f"{db}: not vacuumed: {error.orig} (another writer, or no room for the two copies it "
                "writes)", EXIT_REFUSED)
    except ReadModelUnusable as error:
        _refuse("vacuum", str(error), EXIT_REFUSED)
    finally:
        engine.dispose()
    typer.echo(f"{db}: vacuumed, {before:,} bytes before, {_bytes_on_disk(db):,} now (with its WAL)")


@db_app.command("backup")
def db_backup_command(
    db: Annotated[Path, typer.Option("--db", help="SQLite read-model file to copy (a projector may keep writing it).")],
    out: Annotated[Path, typer.Option("--out", help="The copy to write; refused when it exists.")],
) -> None:
    """Copy a read-model database consistently while a projector writes it (VACUUM INTO: every committed batch, those
    still in its WAL too, which copying the file alone misses). Restore: stop the projector, put the copy in the
    file's place (no -wal or -shm file of the old one beside it) and start it: it goes on from the copy's positions."""
    from sqlalchemy.exc import OperationalError

    from hearth.readmodels.db import ReadModelUnusable, backup_database, open_engine

    if not db.is_file():
        _refuse("backup", f"{db}: no such read-model file", EXIT_BAD_INPUT)
    if out.exists() or out.is_symlink():
        _refuse("backup", f"{out} exists: name a new file (a backup never replaces one)", EXIT_BAD_INPUT)
    if not out.parent.is_dir():
        _refuse("backup", f"{out}: {out.parent} is not a folder", EXIT_BAD_INPUT)
    engine = open_engine(db)
    try:
        backup_database(engine, out)
    except OperationalError as error:
        _refuse("backup", f"{db}: not copied to {out}: {error.orig}", EXIT_REFUSED)
    except ReadModelUnusable as error:
        _refuse("backup", str(error), EXIT_REFUSED)
    except FileExistsError:
        _refuse("backup", f"{out} appeared while it was written: name a new file (a backup never replaces one)",
                EXIT_BAD_INPUT)
    finally:
        engine.dispose()
    typer.echo(f"{db}: copied to {out} ({out.stat().st_size:,} bytes)")


def _refuse(command: str, why: str, code: int) -> NoReturn:
    """End `hearth db COMMAND` with its one line, named as every command's refusal is."""
    typer.echo(f"hearth db {command}: {why}", err=True)
    raise typer.Exit(code)


def _bytes_on_disk(db: Path) -> int:
    wal = db.with_name(db.name + "-wal")
    return db.stat().st_size + (wal.stat().st_size if wal.exists() else 0)
