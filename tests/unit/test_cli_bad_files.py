"""Files a command cannot use end it in one line, no traceback, nothing half-written left behind: a folder it cannot
create (services.cli_errors.OneLineErrorsGroup, `hearth`'s and `hearth-replay`'s), `hearth-replay --creds` naming
a key file that is missing or readable by others, and a random checkpoint whose writing a stop or a full disk cut
short."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from hearth.services.cli import app
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


def test_a_folder_a_command_cannot_create_is_one_line_naming_it(a_file):
    line = said_in_one_line(CliRunner().invoke(app, ["dashboards", "build", "--out", str(a_file / "dashboards")]),
                            1, f"{a_file / 'dashboards'}: Not a directory")
    assert line.split(":")[0].endswith("dashboards"), line


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
