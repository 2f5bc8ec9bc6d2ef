"""How the command lines (`hearth`, `hearth-replay`) end a command that nothing nearer refused: one line, no
traceback."""

from __future__ import annotations

import errno

import click
import typer
from typer.core import TyperGroup

# A file a command cannot use: as services.cli_options.EXIT_REFUSED.
EXIT_FILE_ERROR = 1


class OneLineErrorsGroup(TyperGroup):
    """A command line (`hearth`, `hearth-replay`) whose commands end on a file they cannot create, read or write that
    nothing nearer handled (a read-only or full folder, a file where a folder goes) with one line naming the file and
    why, exit code 1, instead of a traceback (logged at DEBUG)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except OSError as error:
            if error.errno == errno.EPIPE:  # stdout closed by a pager: click's own quiet exit
                raise
            import logging

            logging.getLogger("hearth").debug("the command ended on a file system error", exc_info=True)
            command = " ".join(filter(None, ((ctx.info_name or self.name), ctx.invoked_subcommand)))
            where = f"{error.filename}: " if error.filename is not None else ""
            typer.echo(f"{command}: {where}{error.strerror or error}", err=True)
            raise typer.Exit(EXIT_FILE_ERROR) from None
