"""Files a command cannot use end it in one line, no traceback, nothing half-written left behind: a folder it cannot
create (services.cli_errors.OneLineErrorsGroup, `hearth`'s, each of its groups', and `hearth-replay`'s), named by
the whole command and, where a file stands where a folder goes, said plainly, `hearth-replay --creds` naming
a key file that is missing or readable by others, and a random checkpoint whose writing a stop or a full disk cut
short."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.core import TyperGroup
from typer.testing import CliRunner

from hearth.services.cli import app
from hearth.services.cli_errors import OneLineErrorsGroup
from hearth.services.devtools import random_models
from hearth.services.replay.cli import app as replay_app

UNREACHABLE = "nats://127.0.0.1:1"


def said_in_one_line(result, code: int, *named: str) -> str:
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and all(name in lines[0] for name in named), result.output
    return lines[0]


@pytest.fixture()
def a_file(tmp_path) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text("not a folder")
    return path


@pytest.mark.parametrize("key", ["missing", "readable-by-others"])
def test_hearth_replay_refuses_a_key_file_it_cannot_use_in_one_line(key, tmp_path):
    path = tmp_path / "member.nk"
    if key == "readable-by-others":
        path.write_text("SUAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA")
        path.chmod(0o644)
    result = CliRunner().invoke(replay_app, ["--creds", str(path), "events", "--nats", UNREACHABLE])
    said_in_one_line(result, 1, "hearth-replay: ", str(path))  # as every command: EXIT_REFUSED


@pytest.mark.parametrize("failure", [KeyboardInterrupt, OSError(28, "No space left on device")],
                         ids=["stopped", "disk-full"])
def test_a_random_checkpoint_cut_short_leaves_nothing_half_written(failure, tmp_path, monkeypatch):
    def cut_short(folder: Path, vocab_size: int) -> None:
        assert any(folder.iterdir())  # the weights are written by now
        raise failure

    monkeypatch.setattr(random_models, "write_random_tokenizer", cut_short)
    with pytest.raises(type(failure) if isinstance(failure, BaseException) else failure):
        random_models.random_checkpoint("random:tiny", cache_dir=tmp_path)
    assert list((tmp_path / "random-models").iterdir()) == []


@pytest.mark.parametrize(("command", "code"), [("upgrade", 1), ("vacuum", 2)])
def test_hearth_db_names_itself_in_its_refusal(command, code, tmp_path):
    said_in_one_line(CliRunner().invoke(app, ["db", command, "--db", str(tmp_path)]), code,
                     f"hearth db {command}: {tmp_path}: ")


@pytest.mark.parametrize(("args", "under"), [(["db", "upgrade", "--db"], "readmodel.sqlite"),
                                             (["dashboards", "build", "--out"], "dashboards")],
                         ids=["db-upgrade", "dashboards-build"])
def test_a_file_where_a_folder_goes_is_named_by_the_whole_command_and_said_plainly(args, under, a_file):
    line = said_in_one_line(CliRunner().invoke(app, [*args, str(a_file / under)]), 1)
    assert line.startswith(f"{app.info.name} {args[0]} {args[1]}: "), line
    assert line.endswith(f"{a_file} is not a folder"), line
    assert "File exists" not in line and "Not a directory" not in line, line


def test_every_group_of_hearth_ends_a_file_error_in_one_line_of_its_own():
    def groups(command):
        if isinstance(command, TyperGroup):  # typer's own copy of click's Group: as every group typer builds
            yield command
            for name in command.list_commands(typer.Context(command)):
                yield from groups(command.get_command(typer.Context(command), name))

    every_group = list(groups(typer.main.get_command(app)))
    assert {group.name for group in every_group} >= {"hearth", "db", "community", "dashboards", "weights"}
    assert [group.name for group in every_group if not isinstance(group, OneLineErrorsGroup)] == []
