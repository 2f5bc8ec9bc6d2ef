"""The command lines the docs show exist: every `hearth` and `hearth-replay` line of a shell block in README.md,
BENCHMARKS.md and docs/*.md parses with the CLI's own parser (its command, its flags, their values), and every such
command quoted in the text names a command and flags the CLI has. An operator follows them literally."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer.main
from typer import _click as click

from hearth.services.cli import app
from hearth.services.replay.cli import app as replay_app

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
PROGRAMS = {"hearth": typer.main.get_command(app), "hearth-replay": typer.main.get_command(replay_app)}
# A command line as the docs write one: environment assignments, then the program (.venv/bin/ in a checkout).
COMMAND_LINE = re.compile(r"^(?:sudo )?(?:[A-Z_]+=\S* +)*(?:\.venv/bin/)?(hearth(?:-replay)?)(?: (.*))?$")


def shell_lines(text: str) -> list[str]:
    """Each line of the ```sh blocks, continuation lines joined, comments cut."""
    lines = []
    for block in re.findall(r"```(?:sh|bash)\n(.*?)```", text, flags=re.DOTALL):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            lines.append(re.sub(r"\s+#.*$", "", line).strip())
    return lines


def quoted_commands(text: str) -> list[str]:
    return [span.strip() for span in re.findall(r"`([^`\n]+)`", text) if COMMAND_LINE.match(span.strip())]


def documented(kind) -> list[tuple[str, str]]:
    return [(path.relative_to(ROOT).as_posix(), line) for path in DOCUMENTS
            for line in kind(path.read_text(encoding="utf-8")) if COMMAND_LINE.match(line)]


def resolved(line: str) -> tuple[click.Command, list[str]]:
    """The (sub)command `line` runs and the arguments left for it; top-level options are checked on the way."""
    program, rest = COMMAND_LINE.match(line).groups()
    command, args = PROGRAMS[program], shlex.split(rest or "")
    while hasattr(command, "get_command") and args:
        while args and args[0].startswith("--"):
            option = args.pop(0)
            [param] = [p for p in command.params if option.split("=")[0] in p.opts] or [None]
            assert param is not None, f"{line!r}: {command.name} has no option {option}"
            if not param.is_flag and "=" not in option:
                args.pop(0)
        if not args:
            break
        name = args.pop(0)
        sub = command.get_command(click.Context(command), name)
        assert sub is not None, f"{line!r}: {command.name} has no command {name!r}"
        command = sub
    return command, args


def flags_exist(line: str) -> None:
    command, args = resolved(line)
    known = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    unknown = [arg for arg in args if re.match(r"^--?[A-Za-z]", arg) and arg.split("=")[0] not in known]
    assert unknown == [], f"{line!r}: {command.name} has no {unknown}"


@pytest.mark.parametrize("where,line", documented(shell_lines))
def test_every_command_line_of_a_shell_block_parses(where, line):
    line = re.sub(r" \[[^\]]*\]", "", line)  # optional parts written as [--json]
    command, args = resolved(line)
    flags_exist(line)
    if hasattr(command, "get_command"):
        return  # a group shown alone
    try:
        command.make_context(command.name, args)
    except click.exceptions.ClickException as error:
        pytest.fail(f"{where}: {line!r}: {error.format_message()}")


@pytest.mark.parametrize("where,line", documented(quoted_commands))
def test_every_command_quoted_in_the_text_has_its_command_and_flags(where, line):
    if re.search(r"\S[/|]\S", line.split(" --")[0]) or "..." in line or re.search(r" v\d+$", line):
        pytest.skip("a list of commands (publish/list/fetch), an elided line or a key label (hearth link mac v1)")
    flags_exist(line)


def test_the_checks_find_what_is_not_there():
    with pytest.raises(AssertionError):
        flags_exist("hearth chat --no-such-flag x")
    with pytest.raises(AssertionError):
        resolved("hearth community no-such-command")
    blocks = documented(shell_lines)
    assert ("README.md", ".venv/bin/hearth community api-key --name alice") in blocks
    assert {where for where, _ in blocks} >= {"README.md", "docs/operations.md", "docs/deployment.md",
                                              "docs/gateway.md"}
