"""`hearth cache`: what hearth keeps on this host's disk ($HEARTH_CACHE_DIR) entry by entry (`list`), and the removal
of entries (`clear`); the bodies are hearth/services/cache_inventory.py's."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, NoReturn, Optional

import typer

from hearth.services.cli_options import EXIT_BAD_INPUT

ALL_KINDS = "all"
SIZE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")

cache_app = typer.Typer(
    help="What hearth keeps on this host's disk ($HEARTH_CACHE_DIR, default ~/.cache/hearth): models fetched from the "
         "community's store or the hub, int4 codes, parsed GGUF metadata, random test models. Every entry can be made "
         "again (a fetch, a rounding, a parse).",
    no_args_is_help=True, rich_markup_mode=None)


def _fail(command: str, message: str) -> NoReturn:
    typer.echo(f"hearth cache {command}: {message}", err=True)
    raise typer.Exit(EXIT_BAD_INPUT)


def size_text(size: int) -> str:
    """`size` bytes in the largest binary unit that keeps it at 1 or more ("98.1 MiB")."""
    value, unit = float(size), SIZE_UNITS[0]
    for unit in SIZE_UNITS:
        if value < 1024 or unit == SIZE_UNITS[-1]:
            break
        value /= 1024
    return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"


@cache_app.command("list")
def list_command(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line instead of the table.")] = False,
) -> None:
    """Each entry of hearth's cache: its kind, the name `hearth cache clear` takes, its size on disk, when it was last
    written or used, whether a running process uses it (store and hub models), and what it holds."""
    from hearth.formats.cache_layout import hearth_cache_dir
    from hearth.services.cache_inventory import cache_entries, disk_usage, leftovers

    entries = cache_entries()
    left = sum(disk_usage(folder) for folder in leftovers())
    if as_json:
        for entry in entries:
            typer.echo(json.dumps({"kind": entry.kind, "name": entry.name, "folder": str(entry.folder),
                                   "size_bytes": entry.size_bytes, "last_used": entry.last_used,
                                   "in_use": entry.in_use, "about": entry.about}))
        return
    typer.echo(f"hearth's cache: {hearth_cache_dir()} ($HEARTH_CACHE_DIR moves it)")
    if left:
        typer.echo(f"{size_text(left)} left by a removal cut short: `hearth cache clear all` deletes it")
    if not entries:
        typer.echo("nothing cached")
        return
    rows = [(entry.kind, entry.name, size_text(entry.size_bytes),
             datetime.fromtimestamp(entry.last_used).strftime("%Y-%m-%d %H:%M"),
             "in use" if entry.in_use else "", entry.about) for entry in entries]
    header = ("kind", "name", "size", "last used", "", "holds")
    widths = [max(len(row[column]) for row in (header, *rows)) for column in range(len(header) - 1)]
    for row in (header, *rows):
        typer.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1])
    total = sum(entry.size_bytes for entry in entries)
    typer.echo(f"{len(entries)} entries, {size_text(total)}; remove with `hearth cache clear KIND [NAME ...]`")


@cache_app.command("clear")
def clear_command(
    kind: Annotated[str, typer.Argument(help="store, hub, int4-codes, gguf, random, or all.", show_default=False)],
    names: Annotated[Optional[list[str]], typer.Argument(
        help="The entries to remove, by the name `hearth cache list` shows (default: every entry of KIND).",
        show_default=False)] = None,
) -> None:
    """Remove entries of hearth's cache. A store or hub model's versions that a running process uses are kept (and
    said so); a removed entry costs the next start that needs it a fetch, a rounding or a parse."""
    from hearth.services.cache_inventory import CACHE_KINDS, cache_entries, remove_entry, remove_leftovers

    if kind != ALL_KINDS and kind not in CACHE_KINDS:
        _fail("clear", f"no kind {kind!r}: give one of {', '.join((*CACHE_KINDS, ALL_KINDS))}")
    if kind == ALL_KINDS and names:
        _fail("clear", "name the kind of the entries to remove, not all")
    kinds = list(CACHE_KINDS) if kind == ALL_KINDS else [kind]
    entries = cache_entries(kinds)
    if names:
        known = {entry.name for entry in entries}
        if missing := [name for name in names if name not in known]:
            there = ", ".join(sorted(known)) or "none"
            _fail("clear", f"no {kind} entry named {', '.join(map(repr, missing))} (there are: {there})")
        entries = [entry for entry in entries if entry.name in names]
    freed = remove_leftovers(kinds)
    for entry in entries:
        removal = remove_entry(entry)
        freed += removal.freed_bytes
        if removal.versions_kept:
            typer.echo(f"kept {removal.versions_kept} version(s) of {entry.kind} {entry.name}: a running process "
                       f"uses them (freed {size_text(removal.freed_bytes)} of {size_text(entry.size_bytes)})")
        else:
            typer.echo(f"removed {entry.kind} {entry.name} ({size_text(removal.freed_bytes)})")
    typer.echo(f"freed {size_text(freed)}" if entries or freed else f"nothing to remove in {', '.join(kinds)}")
