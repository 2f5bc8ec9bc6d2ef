"""How the command lines (`hearth`, `hearth-replay`, `python -m hearth.services.projector`) end a command that
nothing nearer refused: one line, no traceback; a usage error included (one line instead of click's usage, hint and
error lines); and quietly, on a stdout whose reader closed it."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from pathlib import Path

import click
import typer
from typer.core import TyperCommand, TyperGroup

# A file a command cannot use: as services.cli_options.EXIT_REFUSED.
EXIT_FILE_ERROR = 1
# The usage error typer's parser raises (typer.BadParameter's base): typer 0.2x carries its own copy of click, whose
# exceptions are not click's.
UsageError = typer.BadParameter.__mro__[1]


class OneLineUsageError(UsageError):
    """A usage error (a bad option value, an option missing or unknown) said in one line naming the command and
    where its help is; exit code 2."""

    def show(self, file=None) -> None:
        command = self.ctx.command_path if self.ctx is not None else "hearth"
        typer.echo(f"{command}: {self.format_message()} (see {command} --help)", file=file, err=file is None)


@contextlib.contextmanager
def usage_errors_in_one_line():
    try:
        yield
    except UsageError as error:
        # One with a display of its own keeps it: a command given no arguments shows its help.
        if type(error).show is not UsageError.show:
            raise
        raise OneLineUsageError(error.format_message(), error.ctx) from None


class _OneLineErrors:
    """A command line (`hearth`, `hearth-replay`) whose refusals are one line each: a usage error (exit code 2), and
    a file a command cannot create, read or write that nothing nearer handled (a read-only or full folder, a file
    where a folder goes): the whole command, the file and why, exit code 1, instead of a traceback (logged at
    DEBUG). A command line's nested groups (`hearth db`) are of this class too, so the one nearest the failing
    command names it whole (`hearth db upgrade: ...`)."""

    def make_context(self, info_name, args, parent=None, **extra):
        with usage_errors_in_one_line():  # the top-level options' own
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context):
        try:
            with usage_errors_in_one_line():  # every command's, and the sub-apps' (`hearth community ...`)
                return super().invoke(ctx)
        except OSError as error:
            if error.errno == errno.EPIPE:  # stdout closed by a pager: click's own quiet exit
                raise
            import logging

            logging.getLogger("hearth").debug("the command ended on a file system error", exc_info=True)
            # The whole command (`hearth db upgrade`): every group of a command line is one of these, so the one
            # nearest the command that failed says it.
            command = " ".join(filter(None, (ctx.command_path or self.name, ctx.invoked_subcommand)))
            typer.echo(f"{command}: {file_error_said_plainly(error)}", err=True)
            raise typer.Exit(EXIT_FILE_ERROR) from None


def file_error_said_plainly(error: OSError) -> str:
    """The file of ``error`` and why it could not be used; a file where a folder goes (which mkdir calls "File
    exists" and open "Not a directory") said as such, naming that file."""
    if error.filename is None:
        return error.strerror or str(error)
    path = os.fsdecode(error.filename)
    if error.errno in (errno.EEXIST, errno.ENOTDIR):
        not_a_folder = next((part for part in (path, *map(str, Path(path).parents))
                             if os.path.lexists(part) and not os.path.isdir(part)), None)
        if not_a_folder is not None:
            return f"{not_a_folder} is not a folder" if not_a_folder == path else (
                f"{path}: {not_a_folder} is not a folder")
    return f"{path}: {error.strerror or error}"


class OneLineErrorsGroup(_OneLineErrors, TyperGroup):
    """A command line of several commands (`hearth`, `hearth-replay`) that refuses in one line (_OneLineErrors)."""


class OneLineErrorsCommand(_OneLineErrors, TyperCommand):
    """A command line of one command (`python -m hearth.services.projector`) that refuses in one line, as
    OneLineErrorsGroup's do (_OneLineErrors)."""


def stdout_to_devnull() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of what is still buffered meets no broken
    pipe when a reader such as `head` closed it early (Python's own advice:
    docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
